// Local training on the phone: train_step.pte (forward + backward) in ExecuTorch's training API, then SGD.
package org.fedgc.phone

import org.pytorch.executorch.EValue
import org.pytorch.executorch.Tensor
import org.pytorch.executorch.training.SGD
import org.pytorch.executorch.training.TrainingModule

/**
 * The phone's counterpart of android_bridge.runtime.PteTrainer: set the global parameters, run
 * `forward` with backward for each batch, step SGD, read the trained parameters back.
 * The ExecuTorch training API is marked experimental; its package has moved between releases
 * (org.pytorch.executorch vs org.pytorch.executorch.training) — match the AAR version.
 */
class LocalTrainer(model: ExportedModel, private val batchShape: LongArray) {
    private val module: TrainingModule = TrainingModule.load(model.trainStepPte.absolutePath)
    private val names = model.parameters.map { it.name }
    // The training program names its parameters with a prefix (manifest "training.parameter_prefix").
    private val prefix = org.json.JSONObject(model.manifestText).getJSONObject("training")
        .optString("parameter_prefix", "")

    /** Copy [params] into the module's parameter buffers (same order and sizes as the export). */
    fun setParameters(params: Map<String, FloatArray>) {
        val held = module.namedParameters("forward")
        for (name in names) {
            val dst = held[prefix + name] ?: error("train_step.pte has no parameter '$prefix$name'")
            val src = params.getValue(name)
            // Parameter tensors share the program's memory: write through the buffer.
            dst.dataAsFloatArray.let { require(it.size == src.size) { "'$name': ${src.size} values for ${it.size}" } }
            module.setParameter(prefix + name, src)
        }
    }

    /** One SGD step per batch; returns the loss of each step. */
    fun train(batches: Sequence<Pair<FloatArray, LongArray>>, learningRate: Double): List<Float> {
        val sgd = SGD.create(module.namedParameters("forward"), learningRate)
        val losses = ArrayList<Float>()
        for ((x, y) in batches) {
            val out = module.executeForwardBackward("forward",
                EValue.from(Tensor.fromBlob(x, batchShape)),
                EValue.from(Tensor.fromBlob(y, longArrayOf(y.size.toLong()))))
            losses.add(out[0].toTensor().dataAsFloatArray[0])
            sgd.step(module.namedGradients("forward"))
        }
        return losses
    }

    /** The trained parameters, copied out. */
    fun parameters(): Map<String, FloatArray> =
        module.namedParameters("forward").let { held ->
            names.associateWith { held.getValue(prefix + it).dataAsFloatArray.copyOf() }
        }
}

/** Write float values into a TrainingModule parameter (helper kept apart from the API surface). */
private fun TrainingModule.setParameter(name: String, values: FloatArray) {
    val t = namedParameters("forward").getValue(name)
    t.getRawDataBuffer().asFloatBuffer().put(values)
}
