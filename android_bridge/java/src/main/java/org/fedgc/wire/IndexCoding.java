package org.fedgc.wire;

/**
 * How a tensor's indices are stored; {@link #AUTO} asks the encoder for the smallest per tensor.
 */
public enum IndexCoding {
    /** Per tensor the smallest section among the codings that can carry it (encoder only). */
    AUTO(-1),
    /** Every entry is carried: no index bytes. */
    ALL(0),
    /** Each index as a little-endian u32 (tensors of at most 2^32 entries). */
    RAW(1),
    /** One bit per entry, LSB first. */
    BITMAP(2),
    /** Golomb-Rice codes of the gaps between consecutive indices. */
    GOLOMB(3);

    /** The {@code index_coding} byte of a tensor record; -1 for {@link #AUTO}. */
    public final int wireId;

    IndexCoding(int wireId) {
        this.wireId = wireId;
    }

    /** The coding with this wire id, or {@code null} when the id is unknown. */
    public static IndexCoding fromWireId(int id) {
        for (IndexCoding c : values()) {
            if (c.wireId == id && c != AUTO) {
                return c;
            }
        }
        return null;
    }

    /** The coding named like the Python {@code index_coding} argument: auto, all, raw, ... */
    public static IndexCoding fromName(String name) {
        for (IndexCoding c : values()) {
            if (c.pythonName().equals(name)) {
                return c;
            }
        }
        throw new IllegalArgumentException("index coding '" + name
                + "' is not one of [auto, all, raw, bitmap, golomb]");
    }

    /** The Python name of the coding (auto, all, raw, bitmap, golomb). */
    public String pythonName() {
        return name().toLowerCase(java.util.Locale.ROOT);
    }
}
