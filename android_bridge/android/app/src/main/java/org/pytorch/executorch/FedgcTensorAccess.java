package org.pytorch.executorch;

import java.nio.FloatBuffer;

/**
 * Writes into a tensor's data buffer. It lives in ExecuTorch's package because
 * {@code Tensor.getRawDataBuffer()} is package-private. Used to load the global model into the
 * parameters of a {@link org.pytorch.executorch.training.TrainingModule}: that works only if the
 * parameter tensors returned by {@code namedParameters} alias the module's native memory, as they
 * do in ExecuTorch's Python bindings. NOT verified on a device (see README).
 */
public final class FedgcTensorAccess {
    private FedgcTensorAccess() {
    }

    /** Copies {@code src} into the float32 tensor {@code t} (same number of elements). */
    public static void writeFloats(Tensor t, float[] src) {
        if (t.dtype() != DType.FLOAT || t.numel() != src.length) {
            throw new IllegalArgumentException("expected a float32 tensor of " + src.length
                    + " elements, got " + t);
        }
        FloatBuffer buffer = (FloatBuffer) t.getRawDataBuffer();
        buffer.rewind();
        buffer.put(src);
    }
}
