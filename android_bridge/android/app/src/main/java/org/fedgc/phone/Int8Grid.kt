// Version 0 of an int8 broadcast, as the server rounds it: dgc/int8_grid.py's round_initial.
package org.fedgc.phone

/**
 * The int8 broadcast grid's first step per matrix: every tensor of two or more dimensions
 * rounded to multiples q * 2^e, |q| <= 127, where e is 3 (HEADROOM_BITS) coarser than the finest
 * step that holds the tensor's largest entry; vectors unchanged. Bit for bit what
 * dgc.int8_grid.round_initial computes (round half to even, like torch.round), so that a patch
 * on the server's version 0 applies to it.
 */
object Int8Grid {
    private const val HEADROOM_BITS = 3
    private const val MIN_EXPONENT = -126
    private const val MAX_EXPONENT = 120

    /** ceil(log2(peak / 127)) clamped, as grid_exponent (null for an all-zero tensor). */
    private fun gridExponent(values: FloatArray): Int? {
        var peak = 0.0
        for (v in values) peak = maxOf(peak, Math.abs(v.toDouble()))
        if (peak == 0.0) return null
        val x = peak / 127.0
        val e = Math.getExponent(x)  // x = 1.f * 2^e
        val exponent = if (x == Math.scalb(1.0, e)) e else e + 1
        return exponent.coerceIn(MIN_EXPONENT, MAX_EXPONENT)
    }

    fun roundInitial(model: Map<String, FloatArray>, parameters: List<Parameter>): Map<String, FloatArray> =
        parameters.associate { p ->
            val t = model.getValue(p.name)
            val e = if (p.shape.size > 1) gridExponent(t) else null
            if (e == null) p.name to t.copyOf()
            else {
                val step = minOf(e + HEADROOM_BITS, MAX_EXPONENT)
                val scale = Math.scalb(1.0f, step)
                p.name to FloatArray(t.size) { i ->
                    val q = Math.rint((t[i] / scale).toDouble()).coerceIn(-127.0, 127.0).toFloat()
                    q * scale + 0.0f
                }
            }
        }
}
