// The phone's own training examples: a float32 input file and an int64 label file in app storage.
package org.fedgc.phone

import android.content.Context
import org.json.JSONObject
import java.io.File
import java.nio.ByteBuffer
import java.nio.ByteOrder
import java.util.Random

/**
 * Reads `fedgc_data/x.f32` (row-major float32, little-endian) and `fedgc_data/y.i64` from the
 * app's files dir; the input shape per example comes from the manifest's "training" entry.
 * Full batches only (the exported training step has a fixed batch), epochs wrap around.
 */
object LocalData {
    private fun dir(c: Context) = File(c.filesDir, "fedgc_data")

    fun size(c: Context): Int = (File(dir(c), "y.i64").length() / 8).toInt()

    /** The batch input shape recorded by the export (e.g. [32, 1, 28, 28]). */
    fun batchShape(model: ExportedModel): LongArray {
        val s = JSONObject(model.manifestText).getJSONObject("training").getJSONArray("input_shape")
        return LongArray(s.length()) { s.getLong(it) }
    }

    fun batches(c: Context, batchSize: Int, steps: Int, seed: Long): Sequence<Pair<FloatArray, LongArray>> {
        val x = ByteBuffer.wrap(File(dir(c), "x.f32").readBytes()).order(ByteOrder.LITTLE_ENDIAN).asFloatBuffer()
        val y = ByteBuffer.wrap(File(dir(c), "y.i64").readBytes()).order(ByteOrder.LITTLE_ENDIAN).asLongBuffer()
        val n = y.limit()
        val width = x.limit() / n
        val rng = Random(seed)
        return sequence {
            var order = IntArray(0)
            repeat(steps) {
                while (order.size < batchSize) order += (0 until n).shuffled(rng).toIntArray()
                val idx = order.copyOf(batchSize)
                order = order.copyOfRange(batchSize, order.size)
                val bx = FloatArray(batchSize * width)
                val by = LongArray(batchSize)
                for ((j, i) in idx.withIndex()) {
                    for (k in 0 until width) bx[j * width + k] = x.get(i * width + k)
                    by[j] = y.get(i)
                }
                yield(bx to by)
            }
        }
    }
}
