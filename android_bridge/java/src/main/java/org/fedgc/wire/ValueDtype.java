package org.fedgc.wire;

/** The value dtypes of wire format version 1, with their wire ids and raw-bit layout. */
public enum ValueDtype {
    /** IEEE-754 binary32, carried as its 32-bit pattern. */
    FLOAT32(0, 4, 0x7F800000),
    /** IEEE-754 binary16, carried as its 16-bit pattern. */
    FLOAT16(1, 2, 0x7C00),
    /** bfloat16 (the upper 16 bits of a binary32), carried as its 16-bit pattern. */
    BFLOAT16(2, 2, 0x7F80);

    /** The {@code value_dtype} byte of a tensor record. */
    public final int wireId;
    /** Bytes per value on the wire. */
    public final int sizeBytes;
    /** Exponent field mask; a value whose exponent is all ones is NaN or infinity (rejected). */
    public final int exponentMask;

    ValueDtype(int wireId, int sizeBytes, int exponentMask) {
        this.wireId = wireId;
        this.sizeBytes = sizeBytes;
        this.exponentMask = exponentMask;
    }

    /** Whether the raw pattern {@code bits} (zero-extended) is a finite value of this dtype. */
    public boolean isFinite(int bits) {
        return (bits & exponentMask) != exponentMask;
    }

    /** The dtype with this wire id, or {@code null} when the id is unknown. */
    public static ValueDtype fromWireId(int id) {
        for (ValueDtype d : values()) {
            if (d.wireId == id) {
                return d;
            }
        }
        return null;
    }

    /** The dtype named like Python's {@code torch} dtypes: float32, float16, bfloat16. */
    public static ValueDtype fromName(String name) {
        switch (name) {
            case "float32": return FLOAT32;
            case "float16": return FLOAT16;
            case "bfloat16": return BFLOAT16;
            default:
                throw new IllegalArgumentException("value dtype '" + name
                        + "' is not one of [float32, float16, bfloat16]");
        }
    }

    /** The Python name of the dtype (float32, float16, bfloat16). */
    public String pythonName() {
        return name().toLowerCase(java.util.Locale.ROOT);
    }
}
