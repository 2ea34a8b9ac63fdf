package org.fedgc.wire;

/**
 * Bytes handed to {@link WireCodec#decode} are not a valid version-1 message.
 *
 * <p>{@link #reason()} says which rule of WIRE_FORMAT.md section 6 failed (stable, for code);
 * the message names the bad value (for people). Decoding either returns a complete update or
 * throws this; nothing partial is ever returned.
 */
public final class DecodeException extends Exception {
    private static final long serialVersionUID = 1L;

    /** Why a message was rejected, one constant per rule of the specification. */
    public enum Reason {
        /** A field, name or section runs past the end (or the input is under 22 bytes). */
        TRUNCATED,
        /** The first four bytes are not "FGCU". */
        BAD_MAGIC,
        /** The version byte is not 1. */
        UNSUPPORTED_VERSION,
        /** The flags byte is not 0. */
        UNSUPPORTED_FLAGS,
        /** Bytes remain between the last tensor record and the checksum. */
        TRAILING,
        /** The stored CRC-32 differs from the computed one. */
        BAD_CHECKSUM,
        /** A tensor name is not valid (strict) UTF-8. */
        BAD_UTF8,
        /** Two tensors have the same name. */
        DUPLICATE_NAME,
        /** A dim above 2^62, a numel above 2^62, or above the caller's maxNumel. */
        TOO_LARGE,
        /** A tensor claims more entries than its shape has. */
        COUNT_ABOVE_NUMEL,
        /** The index_coding byte is not 0..3. */
        UNKNOWN_CODING,
        /** The value_dtype byte is not 0..2. */
        UNKNOWN_DTYPE,
        /** An index section whose length, parameter, padding or number of codes is wrong. */
        BAD_INDEX_SECTION,
        /** An index not above its predecessor (repeated or unsorted). */
        INDEX_NOT_INCREASING,
        /** An index or gap at or above the tensor's numel. */
        INDEX_OUT_OF_RANGE,
        /** A NaN or infinite value (a sign-coded tensor's scale included). */
        NON_FINITE_VALUE,
        /** A sign-coded value section whose scale is zero or negative, or whose padding after
         *  the last sign bit is not zero. */
        BAD_VALUE_SECTION,
        /** A rank request ({@link RankRequest}) whose set does not fit the model: a tensor the
         *  model lacks or of another size, a count of 0 or above its size, more entries drawn
         *  at random than the set holds. */
        BAD_RANKED_SET,
        /** An index set mask ({@link SharedMask}, {@code FGCM}) whose set does not fit: a tensor
         *  the model lacks or of another size, more entries than its tensor, or a section past
         *  the end of the message. */
        BAD_INDEX_SET,
        /** A compact message ({@link CompactCodec}, {@code FGCK}) about another layout: its
         *  digest is not that of the model's tensors (another model, or other sets). */
        WRONG_LAYOUT,
        /** A compact message's varint that is not canonical (a final zero byte after the
         *  first), longer than 10 bytes, or above 2^64 - 1. */
        BAD_VARINT,
        /** A compact message with more tensors than its layout, or a tensor place beyond it. */
        BAD_PLACE
    }

    private final Reason reason;

    /** A rejection for {@code reason} with a message naming the bad value. */
    public DecodeException(Reason reason, String message) {
        super(message);
        this.reason = reason;
    }

    /** Which rule failed. */
    public Reason reason() {
        return reason;
    }
}
