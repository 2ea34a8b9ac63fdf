package org.fedgc.phone;

import org.json.JSONException;
import org.json.JSONObject;

/**
 * The DGCConfig fields the phone's host code reads (the rest are baked into encoder.pte), with
 * the warm-up schedule and k exactly as dgc.config / dgc.selection compute them.
 */
public final class DgcConfig {
    public final double density;
    public final String warmup;
    public final int warmupEpochs;
    public final double[] warmupDensities;
    public final int denseEpochs;
    public final long minSparseNumel;
    public final Double clipNorm;
    public final int numWorkers;
    public final String valueDtype;
    /** The fields the exported graph has baked in, as one comparable string. */
    public final String baked;

    private DgcConfig(JSONObject c) throws JSONException {
        density = c.getDouble("density");
        warmup = c.getString("warmup");
        warmupEpochs = c.getInt("warmup_epochs");
        org.json.JSONArray w = c.getJSONArray("warmup_densities");
        warmupDensities = new double[w.length()];
        for (int i = 0; i < warmupDensities.length; i++) {
            warmupDensities[i] = w.getDouble(i);
        }
        denseEpochs = c.getInt("dense_epochs");
        minSparseNumel = c.getLong("min_sparse_numel");
        clipNorm = c.isNull("clip_norm") ? null : c.getDouble("clip_norm");
        numWorkers = c.getInt("num_workers");
        valueDtype = c.getString("value_dtype");
        baked = c.getString("selection") + "|" + c.getDouble("momentum") + "|"
                + c.getBoolean("momentum_correction") + "|" + c.getBoolean("nesterov") + "|"
                + c.getDouble("dampening") + "|" + c.getBoolean("momentum_masking") + "|"
                + c.getBoolean("error_feedback") + "|" + valueDtype;
    }

    public static DgcConfig fromJson(JSONObject c) throws JSONException {
        return new DgcConfig(c);
    }

    /** DGCConfig.density_at. */
    public double densityAt(double epoch) {
        long e = (long) Math.floor(epoch);
        if (e < denseEpochs) {
            return 1.0;
        }
        e -= denseEpochs;
        if (warmup.equals("exponential") && e < warmupEpochs) {
            return Math.max(density, Math.pow(4.0, -(e + 1)));
        }
        if (warmup.equals("list") && e < warmupDensities.length) {
            return Math.max(density, warmupDensities[(int) e]);
        }
        return density;
    }

    /** dgc.selection.num_selected. */
    public static int numSelected(int numel, double density) {
        return (int) Math.min(numel, Math.max(1, (long) Math.ceil(numel * density)));
    }

    /** android_bridge.encoder.clip_scale, from the per-tensor float64 sums of squares. */
    public double clipScale(double[] sumSquares) {
        if (clipNorm == null || sumSquares.length == 0) {
            return 1.0;
        }
        double sum = 0.0;
        for (double s : sumSquares) {
            sum += s;
        }
        double total = Math.sqrt(sum);
        double threshold = clipNorm / Math.sqrt(numWorkers);
        return total > threshold ? threshold / total : 1.0;
    }
}
