// What `python -m android_bridge export` wrote, as the phone reads it: manifest.json and the .pte paths.
package org.fedgc.phone

import org.json.JSONObject
import java.io.File

/** The DGC hyperparameters the phone needs on the host side (the rest are baked into encoder.pte). */
data class DgcSettings(
    val density: Double,
    val warmup: String,
    val warmupEpochs: Int,
    val warmupDensities: List<Double>,
    val denseEpochs: Int,
    val minSparseNumel: Long,
    val valueDtype: String,
    val clipNorm: Double?,
    val numWorkers: Int,
) {
    /** Density of the (possibly fractional) epoch, warm-up included: dgc.DGCConfig.density_at. */
    fun densityAt(epoch: Double): Double {
        var e = Math.floor(epoch).toInt()
        if (e < denseEpochs) return 1.0
        e -= denseEpochs
        if (warmup == "exponential" && e < warmupEpochs) return maxOf(density, Math.pow(4.0, -(e + 1.0)))
        if (warmup == "list" && e < warmupDensities.size) return maxOf(density, warmupDensities[e])
        return density
    }

    companion object {
        /** From DGCConfig.to_dict(), as in manifest.json and in a task's config_json. */
        fun fromJson(o: JSONObject): DgcSettings {
            val list = o.optJSONArray("warmup_densities")
            return DgcSettings(
                density = o.getDouble("density"),
                warmup = o.getString("warmup"),
                warmupEpochs = o.getInt("warmup_epochs"),
                warmupDensities = (0 until (list?.length() ?: 0)).map { list!!.getDouble(it) },
                denseEpochs = o.getInt("dense_epochs"),
                minSparseNumel = o.getLong("min_sparse_numel"),
                valueDtype = o.getString("value_dtype"),
                clipNorm = if (o.isNull("clip_norm")) null else o.getDouble("clip_norm"),
                numWorkers = o.getInt("num_workers"),
            )
        }
    }
}

/** One model parameter: name and shape, in the order the training step and the encoder use. */
data class Parameter(val name: String, val shape: LongArray) {
    val numel: Long get() = shape.fold(1L) { a, d -> a * d }
}

/** An export folder copied to the phone (app files dir): encoder.pte, train_step.pte, manifest.json. */
class ExportedModel(val dir: File) {
    val manifestText: String = File(dir, "manifest.json").readText()
    private val manifest = JSONObject(manifestText)
    val parameters: List<Parameter> = manifest.getJSONArray("parameters").let { a ->
        (0 until a.length()).map { i ->
            val p = a.getJSONObject(i)
            val s = p.getJSONArray("shape")
            Parameter(p.getString("name"), LongArray(s.length()) { s.getLong(it) })
        }
    }
    /** DGCConfig.to_dict() of the export: the fields baked into encoder.pte are checked against every task. */
    val dgcJson: JSONObject = manifest.getJSONObject("dgc_config")
    val dgc: DgcSettings = DgcSettings.fromJson(dgcJson)
    /** Methods of encoder.pte; an export that predates `encode_blocked` lacks it. */
    val encoderMethods: Set<String> = manifest.getJSONObject("encoder").getJSONObject("methods").keys().asSequence().toSet()
    /** The fixed batch of train_step.pte: a task asking for another batch_size is refused. */
    val batchSize: Int = manifest.getJSONObject("training").getInt("batch_size")
    /**
     * The server's run-config keys this export was made for ("federation.run_config": method,
     * batch_size, lr and the dgc.* fields baked into encoder.pte); absent in older manifests.
     */
    val runConfig: JSONObject? = manifest.optJSONObject("federation")?.optJSONObject("run_config")
    /**
     * Digests of the version 0 train_step.pte bakes in (manifest "initial_model": "sha256" as
     * built, "int8_grid_sha256" on the int8 broadcast grid; android_bridge/initial_model.py);
     * empty in older manifests, whose phones are sent the dense model first.
     */
    val initialSha256: Map<String, String> = manifest.optJSONObject("initial_model")?.let { o ->
        listOf("sha256", "int8_grid_sha256").filter { o.has(it) }.associateWith { o.getString(it) }
    } ?: emptyMap()
    val encoderPte: File = File(dir, "encoder.pte")
    val trainStepPte: File = File(dir, "train_step.pte")
}
