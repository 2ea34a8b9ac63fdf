// The DGC step on the phone: encoder.pte in the ExecuTorch runtime, residual state on the host.
package org.fedgc.phone

import org.fedgc.wire.HalfFloats
import org.fedgc.wire.SparseTensor
import org.fedgc.wire.SparseUpdate
import org.fedgc.wire.ValueDtype
import org.pytorch.executorch.DType
import org.pytorch.executorch.EValue
import org.pytorch.executorch.Module
import org.pytorch.executorch.Tensor
import org.json.JSONObject

/**
 * What android_bridge.runtime.PteEncoder does in Python, in Kotlin: per tensor, run the exported
 * `encode_blocked` / `encode` (momentum correction, clipping scale, exact top-k, masking) or
 * `encode_dense` method with the state u, v passed in and out, and wrap the result as a
 * wire-format SparseUpdate. The contract is docs/android.md, "The encoder contract".
 *
 * Host-side logic is only what the graph cannot hold: the density schedule and k
 * (dgc.selection.num_selected), the global clipping scale from per-tensor sums of squares, the
 * dense-layer policy, the zero padding of sparse tensors to a multiple of [BLOCK], and restore
 * (fold an unaggregated update back into v).
 */
class DgcEncoder(private val model: ExportedModel) {
    private val module: Module = Module.load(model.encoderPte.absolutePath)
    private val hasBlocked: Boolean = "encode_blocked" in model.encoderMethods
    // State per parameter, zero padded to a multiple of BLOCK (the padding stays zero: a zero
    // gradient never moves it and zeros are never sent), as PteEncoder keeps it.
    private val u = HashMap<String, FloatArray>()
    private val v = HashMap<String, FloatArray>()
    /** Parameters whose momentum exists (after their first step): `fresh` is 0 for them. */
    private val started = HashSet<String>()
    var settings: DgcSettings = model.dgc
        private set
    /** Compress calls so far: 0 before the first (a simulated client holds no residual then). */
    var steps: Int = 0
        private set

    init {
        for (p in model.parameters) {
            val padded = (((p.numel + BLOCK - 1) / BLOCK) * BLOCK).toInt()
            u[p.name] = FloatArray(padded)
            v[p.name] = FloatArray(padded)
        }
    }

    /**
     * Take the DGC config of a task (its config_json "dgc" object). A field baked into
     * encoder.pte that differs from the export is refused, as android_bridge.encoder.check_compatible
     * does: the phone cannot run it and must be re-exported.
     */
    fun reconfigure(taskDgc: JSONObject) {
        val exported = model.dgcJson
        val diff = BAKED_FIELDS.filter { f ->
            f != "selection" && exported.opt(f)?.toString() != taskDgc.opt(f)?.toString()
        }
        check(diff.isEmpty()) {
            "the exported encoder cannot run this config (" + diff.joinToString(", ") { f ->
                "$f: exported ${exported.opt(f)}, requested ${taskDgc.opt(f)}"
            } + "); re-export with the requested config"
        }
        settings = DgcSettings.fromJson(taskDgc)
    }

    private fun isDense(p: Parameter) = p.shape.size <= 1 || p.numel < settings.minSparseNumel

    private fun dtype() = ValueDtype.fromName(settings.valueDtype)

    /** Fold [grads] (flat float32 per parameter) into the state and return what to send. */
    fun compress(grads: Map<String, FloatArray>, epoch: Double, sequence: Long): SparseUpdate {
        for (p in model.parameters) {
            val g = grads[p.name] ?: error("gradient of '${p.name}' missing")
            require(g.size.toLong() == p.numel) { "gradient '${p.name}' has ${g.size} entries, expected ${p.numel}" }
            require(g.all { it.isFinite() }) { "gradient '${p.name}' contains NaN or Inf; nothing was changed" }
        }
        val scale = floatArrayOf(clipScale(grads).toFloat())
        val density = settings.densityAt(epoch)
        val out = LinkedHashMap<String, SparseTensor>()
        val newU = HashMap<String, FloatArray>()
        val newV = HashMap<String, FloatArray>()
        for (p in model.parameters) {
            val n = p.numel.toInt()
            val g = grads.getValue(p.name)
            val uFull = u.getValue(p.name)
            val vFull = v.getValue(p.name)
            val padded = uFull.size
            // fresh = 1 on a parameter's first step: the momentum starts as the gradient itself
            // (torch.optim.SGD's buffer, as dgc.DGCMemory keeps it).
            val fresh = EValue.from(Tensor.fromBlob(floatArrayOf(if (p.name in started) 0f else 1f), longArrayOf(1)))
            val scaleIn = EValue.from(Tensor.fromBlob(scale, longArrayOf(1)))
            if (isDense(p)) {
                val r = module.execute("encode_dense", flat(g), flat(uFull.copyOf(n)),
                    flat(vFull.copyOf(n)), scaleIn, fresh)
                newU[p.name] = r[1].toTensor().dataAsFloatArray.copyOf(padded)
                newV[p.name] = r[2].toTensor().dataAsFloatArray.copyOf(padded)
                out[p.name] = tensor(p, LongArray(n) { it.toLong() }, r[0].toTensor())
                continue
            }
            val k = minOf(p.numel, maxOf(1L, Math.ceil(p.numel * density).toLong()))
            // The length of k_like is k: one program serves every warm-up density.
            val kLike = EValue.from(Tensor.fromBlob(FloatArray(k.toInt()), longArrayOf(k)))
            val r = if (hasBlocked && k <= padded / BLOCK) {
                // Exact top-k through the k largest blocks of 32 (falls back in the graph on a
                // tie at the k-th magnitude): the zero-padded gradient and the padded state.
                module.execute("encode_blocked", flat(g.copyOf(padded)), flat(uFull), flat(vFull),
                    scaleIn, fresh, kLike)
            } else {
                module.execute("encode", flat(g), flat(uFull.copyOf(n)), flat(vFull.copyOf(n)),
                    scaleIn, fresh, kLike)
            }
            val count = r[2].toTensor().dataAsLongArray[0].toInt()
            newU[p.name] = r[3].toTensor().dataAsFloatArray.copyOf(padded)
            newV[p.name] = r[4].toTensor().dataAsFloatArray.copyOf(padded)
            val indices = r[0].toTensor().dataAsLongArray.copyOf(count)
            out[p.name] = tensor(p, indices, r[1].toTensor(), count)
        }
        u.putAll(newU)
        v.putAll(newV)
        if (model.dgcJson.optBoolean("momentum_correction")) started.addAll(newU.keys)
        steps++
        return SparseUpdate(out, sequence)
    }

    /** The selected values as the wire dtype's raw bits. */
    private fun tensor(p: Parameter, indices: LongArray, values: Tensor, count: Int = indices.size): SparseTensor {
        val d = dtype()
        if (d == ValueDtype.FLOAT32) {
            return SparseTensor.ofFloat32(p.shape, indices, values.dataAsFloatArray.copyOf(count))
        }
        // The graph outputs the values in the wire's 16-bit dtype. ExecuTorch's Tensor_float16
        // hands out its raw bits (dataAsShortArray): take them as they are. Otherwise (an AAR
        // without that accessor, or bfloat16) read floats and let HalfFloats re-round them, which
        // is exact for values that are already 16-bit.
        if (d == ValueDtype.FLOAT16 && values.dtype() == DType.HALF) {
            return SparseTensor.ofBits16(p.shape, indices, d, values.dataAsShortArray.copyOf(count))
        }
        val floats = values.dataAsFloatArray.copyOf(count)
        val bits = ShortArray(count) {
            if (d == ValueDtype.FLOAT16) HalfFloats.floatToFloat16(floats[it]) else HalfFloats.floatToBfloat16(floats[it])
        }
        return SparseTensor.ofBits16(p.shape, indices, d, bits)
    }

    /** The clipping scale of android_bridge.encoder.clip_scale, from float64 sums of squares. */
    private fun clipScale(grads: Map<String, FloatArray>): Double {
        val clip = settings.clipNorm ?: return 1.0
        var total = 0.0
        for (p in model.parameters) {
            val r = module.execute("sum_squares", flat(grads.getValue(p.name)))
            total += r[0].toTensor().dataAsDoubleArray[0]
        }
        val norm = Math.sqrt(total)
        val threshold = clip / Math.sqrt(settings.numWorkers.toDouble())
        return if (norm > threshold) threshold / norm else 1.0
    }

    /** Fold an update that was never aggregated back into the residual v: no gradient mass is lost. */
    fun restore(update: SparseUpdate) {
        for ((name, t) in update.tensors()) {
            val p = model.parameters.firstOrNull { it.name == name }
                ?: error("update tensor '$name' is not held by this encoder")
            require(t.numel() == p.numel) { "update tensor '$name' has ${t.numel()} entries, residual ${p.numel}" }
        }
        for ((name, t) in update.tensors()) {
            val residual = v.getValue(name)
            for (i in 0 until t.nnz()) residual[t.index(i).toInt()] += t.value(i)
        }
    }

    /**
     * The residual v per parameter (zero padded to a multiple of [BLOCK]), live: the host steps
     * of dgc_sets take the round's shared sets out of it (org.fedgc.wire.GridValues.takeValues,
     * SetsFirst), as android_bridge.runtime.PteEncoder.residual() serves the reference phone.
     */
    fun residual(): Map<String, FloatArray> = v

    private fun flat(a: FloatArray) = EValue.from(Tensor.fromBlob(a, longArrayOf(a.size.toLong())))

    companion object {
        /** encode_blocked's block (android_bridge.encoder.BLOCK, manifest encoder.methods.encode_blocked.block). */
        const val BLOCK = 32L
        /** android_bridge.encoder.BAKED_FIELDS: fixed in encoder.pte at export. */
        val BAKED_FIELDS = listOf("selection", "momentum", "momentum_correction", "nesterov",
            "dampening", "momentum_masking", "error_feedback", "value_dtype", "ternary")
    }
}
