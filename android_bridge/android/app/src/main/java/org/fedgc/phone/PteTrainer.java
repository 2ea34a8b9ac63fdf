package org.fedgc.phone;

import java.util.Map;
import org.pytorch.executorch.EValue;
import org.pytorch.executorch.FedgcTensorAccess;
import org.pytorch.executorch.Tensor;
import org.pytorch.executorch.training.SGD;
import org.pytorch.executorch.training.TrainingModule;

/** train_step.pte with ExecuTorch's training API: forward + backward in the runtime, then SGD. */
public final class PteTrainer {
    private static final String METHOD = "forward";
    private static final String PREFIX = "net.";
    private final TrainingModule module;
    private final long[] batchShape;
    private final Map<String, Tensor> params;

    public PteTrainer(ExportManifest manifest) {
        module = TrainingModule.load(manifest.trainFile().getAbsolutePath());
        batchShape = manifest.batchShape;
        int features = 1;
        for (int i = 1; i < batchShape.length; i++) {
            features *= (int) batchShape[i];
        }
        // As in the Python driver: one call on a zero batch makes the parameters available.
        module.executeForwardBackward(METHOD,
                EValue.from(Tensor.fromBlob(new float[(int) batchShape[0] * features], batchShape)),
                EValue.from(Tensor.fromBlob(new long[(int) batchShape[0]],
                        new long[] {batchShape[0]})));
        params = module.namedParameters(METHOD);
    }

    public int batchSize() {
        return (int) batchShape[0];
    }

    /** Overwrite every parameter with the global model's values (unverified on device). */
    public void setParameters(Map<String, float[]> model) {
        for (Map.Entry<String, Tensor> e : params.entrySet()) {
            float[] src = model.get(e.getKey().substring(PREFIX.length()));
            if (src == null) {
                throw new IllegalArgumentException("global model lacks " + e.getKey());
            }
            FedgcTensorAccess.writeFloats(e.getValue(), src);
        }
    }

    public float[] parameter(String name) {
        return params.get(PREFIX + name).getDataAsFloatArray();
    }

    /** SGD steps over full batches {@code x[b]} (flattened float32) and labels {@code y[b]}. */
    public double train(float[][] xBatches, long[][] yBatches, double learningRate) {
        SGD sgd = SGD.create(params, learningRate, 0.0, 0.0, 0.0, false);
        double lossSum = 0.0;
        for (int b = 0; b < xBatches.length; b++) {
            EValue[] out = module.executeForwardBackward(METHOD,
                    EValue.from(Tensor.fromBlob(xBatches[b], batchShape)),
                    EValue.from(Tensor.fromBlob(yBatches[b], new long[] {batchShape[0]})));
            lossSum += out[0].toTensor().getDataAsFloatArray()[0];
            sgd.step(module.namedGradients(METHOD));
        }
        return lossSum / Math.max(1, xBatches.length);
    }
}
