package org.fedgc.phone;

import java.util.LinkedHashMap;
import java.util.Map;
import org.fedgc.wire.SparseTensor;
import org.fedgc.wire.SparseUpdate;
import org.fedgc.wire.ValueDtype;
import org.pytorch.executorch.EValue;
import org.pytorch.executorch.Module;
import org.pytorch.executorch.Tensor;

/**
 * Runs encoder.pte (methods encode, encode_dense, sum_squares) over a model's gradients and keeps
 * the DGC state (u, v) between rounds: the Java twin of android_bridge.runtime.PteEncoder.
 */
public final class PteEncoder {
    private final Module module;
    private final ExportManifest manifest;
    private DgcConfig config;
    private final Map<String, float[]> u = new LinkedHashMap<>();
    private final Map<String, float[]> v = new LinkedHashMap<>();
    /** Tensors whose momentum exists (after their first step): fresh = 0 for them. */
    private final java.util.Set<String> started = new java.util.HashSet<>();

    public PteEncoder(ExportManifest manifest) {
        this.manifest = manifest;
        this.config = manifest.exportedConfig;
        this.module = Module.load(manifest.encoderFile().getAbsolutePath());
        for (Map.Entry<String, long[]> e : manifest.shapes.entrySet()) {
            int n = (int) SparseTensor.numelOf(e.getValue());
            u.put(e.getKey(), new float[n]);
            v.put(e.getKey(), new float[n]);
        }
    }

    /** Use a task's run-time fields; a change of a baked-in field is refused. */
    public void reconfigure(DgcConfig requested) {
        if (!requested.baked.equals(manifest.exportedConfig.baked)) {
            throw new IllegalArgumentException("encoder.pte was exported for "
                    + manifest.exportedConfig.baked + ", the task asks for " + requested.baked);
        }
        config = requested;
    }

    private static EValue vec(float[] data) {
        return EValue.from(Tensor.fromBlob(data, new long[] {data.length}));
    }

    /** One DGC step over all tensors; the state changes only when every tensor succeeded. */
    public SparseUpdate compress(Map<String, float[]> grads, double epoch, long sequence) {
        for (Map.Entry<String, float[]> e : grads.entrySet()) {
            for (float x : e.getValue()) {
                if (Float.isNaN(x) || Float.isInfinite(x)) {
                    throw new IllegalArgumentException("gradient '" + e.getKey()
                            + "' contains NaN or Inf; nothing was changed");
                }
            }
        }
        double[] squares = new double[config.clipNorm == null ? 0 : grads.size()];
        int i = 0;
        if (config.clipNorm != null) {
            for (float[] g : grads.values()) {
                squares[i++] = module.execute("sum_squares", vec(g))[0].toTensor()
                        .getDataAsDoubleArray()[0];
            }
        }
        EValue scale = vec(new float[] {(float) config.clipScale(squares)});
        ValueDtype dtype = ValueDtype.fromName(config.valueDtype);
        double density = config.densityAt(epoch);
        Map<String, SparseTensor> out = new LinkedHashMap<>();
        Map<String, float[]> newU = new LinkedHashMap<>();
        Map<String, float[]> newV = new LinkedHashMap<>();
        for (Map.Entry<String, float[]> e : grads.entrySet()) {
            String name = e.getKey();
            float[] g = e.getValue();
            long[] shape = manifest.shapes.get(name);
            EValue fresh = vec(new float[] {started.contains(name) ? 0f : 1f});
            EValue[] r;
            long[] indices;
            Tensor values;
            if (manifest.dense.get(name)) {
                r = module.execute("encode_dense", vec(g), vec(u.get(name)), vec(v.get(name)),
                        scale, fresh);
                values = r[0].toTensor();
                indices = new long[g.length];
                for (int j = 0; j < g.length; j++) {
                    indices[j] = j;
                }
                newU.put(name, r[1].toTensor().getDataAsFloatArray());
                newV.put(name, r[2].toTensor().getDataAsFloatArray());
            } else {
                int k = DgcConfig.numSelected(g.length, density);
                r = module.execute("encode", vec(g), vec(u.get(name)), vec(v.get(name)), scale,
                        fresh, vec(new float[k]));
                int count = (int) r[2].toTensor().getDataAsLongArray()[0];
                indices = java.util.Arrays.copyOf(r[0].toTensor().getDataAsLongArray(), count);
                values = r[1].toTensor();
                newU.put(name, r[3].toTensor().getDataAsFloatArray());
                newV.put(name, r[4].toTensor().getDataAsFloatArray());
            }
            int nnz = indices.length;
            if (dtype == ValueDtype.FLOAT32) {
                out.put(name, SparseTensor.ofFloat32(shape, indices,
                        java.util.Arrays.copyOf(values.getDataAsFloatArray(), nnz)));
            } else {
                // HALF tensors expose their raw 16-bit patterns (bfloat16 support in the AAR's
                // Tensor class is not verified; see README).
                out.put(name, SparseTensor.ofBits16(shape, indices, dtype,
                        java.util.Arrays.copyOf(values.getDataAsShortArray(), nnz)));
            }
        }
        u.putAll(newU);
        v.putAll(newV);
        started.addAll(newU.keySet());
        return new SparseUpdate(out, sequence);
    }

    /** Fold an update that was never aggregated back into the residual. */
    public void restore(SparseUpdate update) {
        for (Map.Entry<String, SparseTensor> e : update.tensors().entrySet()) {
            float[] res = v.get(e.getKey());
            float[] vals = e.getValue().valuesAsFloat();
            long[] idx = e.getValue().indices();
            for (int j = 0; j < idx.length; j++) {
                res[(int) idx[j]] += vals[j];
            }
        }
    }
}
