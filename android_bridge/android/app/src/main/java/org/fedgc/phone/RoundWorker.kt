// One federated round on the phone, as a WorkManager job: fetch, train, DGC-compress, encode, upload.
package org.fedgc.phone

import android.content.Context
import androidx.work.Worker
import androidx.work.WorkerParameters
import androidx.work.workDataOf
import org.fedgc.bridge.v1.FetchTaskReply
import org.fedgc.bridge.v1.ModelEncoding
import org.fedgc.wire.CompactCodec
import org.fedgc.wire.ContextPatch
import org.fedgc.wire.DisplacementRanking
import org.fedgc.wire.GridValues
import org.fedgc.wire.IndexCoding
import org.fedgc.wire.RankRequest
import org.fedgc.wire.SetsFirst
import org.fedgc.wire.SharedMask
import org.fedgc.wire.SparseTensor
import org.fedgc.wire.SparseUpdate
import org.fedgc.wire.WireCodec
import org.json.JSONObject
import java.io.File
import java.security.MessageDigest

/**
 * The phone's round, step for step the Python reference phone (android_bridge/phone.py):
 * rebuild the global model from the task's wire-format bytes, train with train_step.pte, form
 * the pseudo-gradient global - local, fold a never-aggregated previous update back into the
 * residual, compress with encoder.pte, WireCodec.encode, and upload with resumption.
 *
 * dgc_sets' host steps (docs/android.md, "What dgc_sets needs on a phone"), through the Java
 * codec's org.fedgc.wire classes, in encoder_round's order: the round's sets derived from a rank
 * request (DisplacementRanking), the sets first (SetsFirst), the top-k's values on the grid
 * (GridValues.valuesOnGrid) written grid-coded, the residual at the sets sent as grid values
 * (GridValues.takeValues, encodeValues), a ranked patch joined (ContextPatch). The sets may
 * also come as the server sends them (an FGCM mask, SharedMask), and a patch as a compact
 * message (FGCK, downlink_compact: CompactCodec on the model's layout and its ranked segments'),
 * which no phone is sent yet: `export` refuses downlink_compact (docs/android.md). Never
 * compiled: see ../README.md. A task that answers its sets with signs is refused.
 */
class RoundWorker(context: Context, params: WorkerParameters) : Worker(context, params) {

    override fun doWork(): Result {
        val deviceId = inputData.getString(KEY_DEVICE_ID) ?: return Result.failure()
        val token = inputData.getString(KEY_TOKEN) ?: return Result.failure()
        val model = ExportedModel(File(applicationContext.filesDir, "fedgc_export"))
        val state = PhoneState.get(model)
        BridgeClient(BuildConfig.BRIDGE_HOST, BuildConfig.BRIDGE_PORT, BuildConfig.BRIDGE_TLS).use { bridge ->
            val manifestSha = MessageDigest.getInstance("SHA-256")
                .digest(model.manifestText.toByteArray()).joinToString("") { "%02x".format(it) }
            bridge.register(deviceId, token, manifestSha)
            // A phone that was never sent a model offers the version 0 its export builds.
            val first = state.model == null && state.initial != null
            val task = bridge.fetchTask(if (first) 0 else state.modelVersion, state.configSha256,
                if (first) model.initialSha256.values.toList() else emptyList())
            if (!task.hasTask) return Result.retry()

            // The bridge sends the config only when it changed; it names it by digest always.
            if (task.configJson.isNotEmpty()) {
                state.configJson = task.configJson
                state.configSha256 = task.configSha256
            } else check(task.configSha256 == state.configSha256) {
                "task carries no config and names ${task.configSha256}, which this phone does not hold"
            }
            val config = JSONObject(state.configJson)
            val train = config.getJSONObject("train")
            // Refuse what the exported files cannot run (as android_bridge.phone does): a baked
            // DGC field or another batch size needs a re-export, not a different computation.
            state.encoder.reconfigure(config.getJSONObject("dgc"))
            val batch = train.getInt("batch_size")
            check(batch == model.batchSize) {
                "task asks for batch_size $batch, the exported training step has ${model.batchSize}"
            }
            val values = config.optJSONObject("values") ?: JSONObject()
            val levels = values.optDouble("levels", 0.0)
            val sharedLevels = values.optDouble("shared_levels", 0.0)
            val global = globalModel(model, state, task)
            val sets = sharedSets(model, state, task, global)
            check(sets == null || sharedLevels > 0) {
                "task ${task.taskId} answers its shared sets with signs, which this app does not send"
            }

            state.trainer.setParameters(global)
            // local_steps 0 (a default run) means local_epochs passes over the phone's data.
            val steps = train.getInt("local_steps").takeIf { it > 0 }
                ?: (train.getInt("local_epochs") * Math.ceil(LocalData.size(applicationContext) / batch.toDouble()).toInt())
            val losses = state.trainer.train(LocalData.batches(applicationContext,
                batch, steps, train.getLong("seed") * 1_000_003 + task.serverRound), train.getDouble("lr"))
            val local = state.trainer.parameters()
            val pseudoGradient = model.parameters.associate { p ->
                val g = global.getValue(p.name)
                val l = local.getValue(p.name)
                p.name to FloatArray(g.size) { g[it] - l[it] }
            }
            val pending = state.pending
            val restored = pending != null && pending.sequence() != task.ackSequence
            if (restored) {
                // As client.state.fold_back_pending: the update, then what the sets sent.
                state.encoder.restore(pending!!)
                state.pendingShared?.let { state.encoder.restore(it) }
            }
            // The sets first (dgc.shared_first): the pseudo-gradient at the sets leaves with the
            // residual there; the encoder gets it zeroed there.
            val first = if (sets != null && values.optBoolean("first")) SetsFirst.split(pseudoGradient,
                state.encoder.residual(), sets, state.encoder.steps > 0, sharedLevels, task.sequence) else null
            var update = state.encoder.compress(first?.gradients ?: pseudoGradient,
                (task.serverRound - 1).toDouble(), task.sequence)
            first?.remainder?.let { state.encoder.restore(it) }
            if (levels > 0) {  // dgc.value_levels: the top-k's values on the grid, the rounding kept
                val (rounded, error) = GridValues.valuesOnGrid(update, levels)
                update = rounded
                state.encoder.restore(error)
            }
            var data = WireCodec.encode(update, IndexCoding.AUTO, levels > 0)
            var sideBytes = 0
            state.pendingShared = null
            if (sets != null) {
                val sent = first?.sent ?: sets.mapValues { (name, set) ->
                    GridValues.takeValues(state.encoder.residual().getValue(name), set, sharedLevels)
                }
                val side = GridValues.encodeValues(sent, task.sequence)
                state.pendingShared = SparseUpdate(sent.mapValues { (name, v) ->
                    SparseTensor.ofFloat32(longArrayOf(global.getValue(name).size.toLong()), sets.getValue(name), v)
                }, task.sequence)
                data += side
                sideBytes = side.size
            }
            state.pending = update
            state.model = global
            state.modelVersion = task.modelVersion

            val metrics = JSONObject().put("num-examples", LocalData.size(applicationContext))
                .put("train_loss", losses.average()).put("restored", if (restored) 1 else 0).toString()
            val uploadId = "$deviceId-${task.taskId}"
            val (starts, status) = bridge.upload(task, uploadId, data, metrics, sideBytes = sideBytes)
            // The stream's answer carries the final state; ask Ack only when it did not.
            val ackState = status?.takeIf { it.complete }?.stateValue ?: bridge.ack(uploadId).stateValue
            return Result.success(workDataOf("uplink_bytes" to data.size, "streams" to starts.size,
                "ack_state" to ackState))
        }
    }

    /** Version 0 in the form [digest] names (as the export built it, or on the int8 grid). */
    private fun version0(model: ExportedModel, state: PhoneState, digest: String): Map<String, FloatArray> {
        val initial = checkNotNull(state.initial) { "version 0 $digest asked of an export that holds none" }
        return when (digest) {
            model.initialSha256["sha256"] -> initial
            model.initialSha256["int8_grid_sha256"] -> Int8Grid.roundInitial(initial, model.parameters)
            else -> error("version 0 $digest, which this phone's export does not build (export it with the run's task and seed)")
        }
    }

    /**
     * The round's shared sets: derived from the model the round trains on and version 0 when the
     * task's shared_mask is a rank request (dgc.shared_rank = displacement), else the sets the
     * mask carries (FGCM, as android_bridge.phone decodes them); null without one.
     */
    private fun sharedSets(model: ExportedModel, state: PhoneState, task: FetchTaskReply,
                           global: Map<String, FloatArray>): Map<String, LongArray>? {
        if (task.sharedMask.isEmpty()) return null
        val bytes = task.sharedMask.toByteArray()
        val numels = model.parameters.associate { it.name to it.numel }
        if (!RankRequest.isRankRequest(bytes)) return SharedMask.decode(bytes, numels).sets()
        val request = RankRequest.decode(bytes, numels)
        return DisplacementRanking.sets(request, global, version0(model, state, task.initialSha256))
    }

    /** The dense global model from a DENSE task, or the held model patched by a SPARSE_PATCH. */
    private fun globalModel(model: ExportedModel, state: PhoneState, task: FetchTaskReply): Map<String, FloatArray> {
        val bytes = task.modelBytes.toByteArray()
        val maxNumel = model.parameters.maxOf { it.numel }
        val update: SparseUpdate = if (task.encoding == ModelEncoding.SPARSE_PATCH && CompactCodec.isCompact(bytes)) {
            // downlink_compact: tensors by place in the model's layout and its ranked segments'
            // (fedgc.patching.apply_patch; the reference phone does not read it).
            val layout = CompactCodec.Layout.patch(model.parameters.associate { it.name to it.shape },
                task.patchContextList)
            CompactCodec.decode(bytes, layout, maxNumel)
        } else WireCodec.decode(bytes, maxNumel)
        if (task.encoding == ModelEncoding.SPARSE_PATCH) {
            val held = if (state.model == null && task.baseVersion == 0L && task.baseSha256.isNotEmpty() && state.initial != null) {
                // The first task, a patch on version 0: the export's own, in the form the bridge named.
                version0(model, state, task.baseSha256)
            } else {
                check(state.model != null && state.modelVersion == task.baseVersion) {
                    "patch on version ${task.baseVersion}, phone holds ${state.modelVersion}"
                }
                state.model!!
            }
            if (task.patchContextCount > 0) {
                // downlink_context: segments of the held model's ranking against version 0.
                val origin = version0(model, state, task.initialSha256)
                return ContextPatch.apply(held, update, task.patchContextList.associateWith { name ->
                    origin[name] ?: error("patch_context names '$name', which version 0 lacks")
                })
            }
            val patched = held.mapValues { it.value.copyOf() }
            for ((name, t) in update.tensors()) {
                val flat = patched[name] ?: error("patch carries unknown tensor '$name'")
                for (i in 0 until t.nnz()) flat[t.index(i).toInt()] = t.value(i)
            }
            return patched
        }
        return model.parameters.associate { p ->
            val t = update.tensors()[p.name] ?: error("dense model lacks '${p.name}'")
            check(t.isDense && t.shape().contentEquals(p.shape)) { "dense model tensor '${p.name}' must carry all of ${p.shape.toList()}" }
            p.name to t.toDense()
        }
    }

    companion object {
        const val KEY_DEVICE_ID = "device_id"
        const val KEY_TOKEN = "token"
    }
}

/** What survives between rounds in this process: residual state, the pending update, the model. */
class PhoneState private constructor(model: ExportedModel) {
    val encoder = DgcEncoder(model)
    val trainer = LocalTrainer(model, LocalData.batchShape(model))
    /** Version 0 as train_step.pte bakes it, read before any task overwrites it (null: an old export). */
    val initial: Map<String, FloatArray>? = if (model.initialSha256.isEmpty()) null else trainer.parameters()
    var pending: SparseUpdate? = null
    /** What the round's shared sets sent beside [pending], folded back with it. */
    var pendingShared: SparseUpdate? = null
    var model: Map<String, FloatArray>? = null
    var modelVersion: Long = -1
    var configJson: String = ""
    var configSha256: String = ""

    companion object {
        @Volatile private var instance: PhoneState? = null
        fun get(model: ExportedModel): PhoneState =
            instance ?: synchronized(this) { instance ?: PhoneState(model).also { instance = it } }
    }
}
