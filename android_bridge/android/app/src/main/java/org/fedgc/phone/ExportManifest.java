package org.fedgc.phone;

import java.io.File;
import java.io.IOException;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.util.LinkedHashMap;
import java.util.Map;
import org.json.JSONArray;
import org.json.JSONException;
import org.json.JSONObject;

/** The manifest.json of {@code python -m android_bridge export}: parameters, batch, config. */
public final class ExportManifest {
    /** Parameter name -> shape, in the model's order. */
    public final Map<String, long[]> shapes = new LinkedHashMap<>();
    /** Parameter name -> whether the layer policy sends it dense. */
    public final Map<String, Boolean> dense = new LinkedHashMap<>();
    public final long[] batchShape;
    public final DgcConfig exportedConfig;
    public final File dir;

    public ExportManifest(File dir) throws IOException, JSONException {
        this.dir = dir;
        String text = new String(Files.readAllBytes(new File(dir, "manifest.json").toPath()),
                StandardCharsets.UTF_8);
        JSONObject m = new JSONObject(text);
        JSONArray params = m.getJSONArray("parameters");
        for (int i = 0; i < params.length(); i++) {
            JSONObject p = params.getJSONObject(i);
            JSONArray s = p.getJSONArray("shape");
            long[] shape = new long[s.length()];
            for (int j = 0; j < shape.length; j++) {
                shape[j] = s.getLong(j);
            }
            shapes.put(p.getString("name"), shape);
            dense.put(p.getString("name"), p.getBoolean("dense"));
        }
        JSONArray b = m.getJSONObject("training").getJSONArray("input_shape");
        batchShape = new long[b.length()];
        for (int j = 0; j < batchShape.length; j++) {
            batchShape[j] = b.getLong(j);
        }
        exportedConfig = DgcConfig.fromJson(m.getJSONObject("dgc_config"));
    }

    public File encoderFile() {
        return new File(dir, "encoder.pte");
    }

    public File trainFile() {
        return new File(dir, "train_step.pte");
    }
}
