package org.fedgc.wire;

/**
 * Conversions between float and the 16-bit value dtypes (IEEE binary16 and bfloat16).
 *
 * <p>To float is exact. From float rounds to nearest, ties to even, like torch's
 * {@code .to(torch.float16)} and {@code .to(torch.bfloat16)}; overflow gives infinity (which the
 * encoder then refuses) and NaN stays NaN. Android's {@code android.util.Half} does the same for
 * binary16 from API 26; this class has no Android dependency so it is tested here.
 */
public final class HalfFloats {
    private HalfFloats() {
    }

    /** The float value of a binary16 pattern. */
    public static float float16ToFloat(short bits) {
        int h = bits & 0xFFFF;
        int sign = (h & 0x8000) << 16;
        int exponent = (h >>> 10) & 0x1F;
        int mantissa = h & 0x3FF;
        if (exponent == 0x1F) {
            return Float.intBitsToFloat(sign | 0x7F800000 | (mantissa << 13));
        }
        if (exponent == 0) {
            // Subnormal (or zero): mantissa * 2^-24, exact in float.
            float magnitude = mantissa * 0x1p-24f;
            return sign != 0 ? -magnitude : magnitude;
        }
        return Float.intBitsToFloat(sign | ((exponent + 112) << 23) | (mantissa << 13));
    }

    /** The binary16 pattern nearest to {@code value} (ties to even). */
    public static short floatToFloat16(float value) {
        int f = Float.floatToRawIntBits(value);
        int sign = (f >>> 16) & 0x8000;
        int exponent = (f >>> 23) & 0xFF;
        int mantissa = f & 0x7FFFFF;
        if (exponent == 0xFF) {
            // Keep NaN a NaN (quiet, top payload bits) and infinity an infinity.
            return (short) (sign | 0x7C00 | (mantissa != 0 ? 0x200 | (mantissa >>> 13) : 0));
        }
        int halfExponent = exponent - 127 + 15;
        if (halfExponent >= 0x1F) {
            return (short) (sign | 0x7C00);
        }
        if (halfExponent <= 0) {
            if (halfExponent < -10) {
                return (short) sign; // below half the smallest subnormal: rounds to zero
            }
            // Subnormal result: shift the implicit-one mantissa into place, then round.
            int full = mantissa | 0x800000;
            int shift = 14 - halfExponent;
            int half = full >>> shift;
            int rest = full & ((1 << shift) - 1);
            int halfway = 1 << (shift - 1);
            if (rest > halfway || (rest == halfway && (half & 1) != 0)) {
                half++;
            }
            return (short) (sign | half);
        }
        int half = (halfExponent << 10) | (mantissa >>> 13);
        int rest = mantissa & 0x1FFF;
        if (rest > 0x1000 || (rest == 0x1000 && (half & 1) != 0)) {
            half++; // a carry into the exponent is the correct rounding (up to infinity)
        }
        return (short) (sign | half);
    }

    /** The float value of a bfloat16 pattern. */
    public static float bfloat16ToFloat(short bits) {
        return Float.intBitsToFloat((bits & 0xFFFF) << 16);
    }

    /** The bfloat16 pattern nearest to {@code value} (ties to even). */
    public static short floatToBfloat16(float value) {
        int f = Float.floatToRawIntBits(value);
        if ((f & 0x7F800000) == 0x7F800000 && (f & 0x7FFFFF) != 0) {
            return (short) ((f >>> 16) | 0x40); // quiet NaN
        }
        int rounding = 0x7FFF + ((f >>> 16) & 1);
        return (short) ((f + rounding) >>> 16);
    }
}
