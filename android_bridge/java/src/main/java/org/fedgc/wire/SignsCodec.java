package org.fedgc.wire;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.CharBuffer;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CharsetEncoder;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.util.ArrayList;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.zip.CRC32;

/**
 * The {@code signs} payload kind ({@code FGCB}, docs/wire.md section 14): a {@link SignsUpdate}
 * to bytes and back, byte-identical to the Python reference
 * ({@code fedgc.methods.efsign.SignsCodec}).
 *
 * <p>{@link #decode} checks the preamble, the tensor count against the bytes and the CRC-32,
 * then reads each record, in the order the Python decoder does, so that both reject a message
 * for the same {@link DecodeException.Reason}; nothing is allocated for a length that is not
 * present. Stateless and thread-safe; only {@code java.util.zip.CRC32}, {@code java.nio}.
 */
public final class SignsCodec {
    /** The message magic, ASCII "FGCB". */
    public static final byte[] MAGIC = {'F', 'G', 'C', 'B'};
    /** The version this codec reads and writes. */
    public static final int VERSION = 1;

    private static final int PREAMBLE_BYTES = 17;
    private static final int CRC_BYTES = 4;
    /** name_len + ndim + scale. */
    private static final int MIN_RECORD_BYTES = 2 + 1 + 4;

    private SignsCodec() {
    }

    /** The bytes of {@code update}, tensors in the map's order. */
    public static byte[] encode(SignsUpdate update) {
        CharsetEncoder utf8 = StandardCharsets.UTF_8.newEncoder()
                .onMalformedInput(CodingErrorAction.REPORT)
                .onUnmappableCharacter(CodingErrorAction.REPORT);
        List<byte[]> names = new ArrayList<>();
        long total = PREAMBLE_BYTES + CRC_BYTES;
        for (Map.Entry<String, SignsTensor> e : update.tensors().entrySet()) {
            byte[] name;
            try {
                ByteBuffer b = utf8.reset().encode(CharBuffer.wrap(e.getKey()));
                name = new byte[b.remaining()];
                b.get(name);
            } catch (CharacterCodingException ex) {
                throw new EncodeException("tensor name '" + e.getKey() + "' is not valid Unicode");
            }
            if (name.length > 0xFFFF) {
                throw new EncodeException("tensor name of " + name.length + " UTF-8 bytes is over "
                        + "65535");
            }
            names.add(name);
            SignsTensor t = e.getValue();
            total += 2 + name.length + 1 + 8L * t.shape().length + 4 + (t.numel() + 7) / 8;
            if (total > Integer.MAX_VALUE - 8) {
                throw new EncodeException("update is beyond a Java byte array");
            }
        }
        ByteBuffer out = ByteBuffer.allocate((int) total).order(ByteOrder.LITTLE_ENDIAN);
        out.put(MAGIC).put((byte) VERSION).putLong(update.sequence())
                .putInt(update.tensors().size());
        int k = 0;
        for (SignsTensor t : update.tensors().values()) {
            byte[] name = names.get(k++);
            long[] shape = t.shape();
            out.putShort((short) name.length).put(name).put((byte) shape.length);
            for (long d : shape) {
                out.putLong(d);
            }
            out.putFloat(t.scale()).put(t.signs());
        }
        CRC32 crc = new CRC32();
        crc.update(out.array(), 0, out.position());
        out.putInt((int) crc.getValue());
        return out.array();
    }

    /**
     * The update {@code data} holds; no tensor may have more than {@code maxNumel} entries (the
     * model's largest: what densifying may allocate).
     *
     * @throws DecodeException for anything that is not a valid message, with the reason
     */
    public static SignsUpdate decode(byte[] data, long maxNumel) throws DecodeException {
        ByteBuffer in = Frames.preamble(data, MAGIC, VERSION, PREAMBLE_BYTES + CRC_BYTES,
                "a message", "FGCB");
        long sequence = in.getLong(5);
        long count = in.getInt(13) & 0xFFFFFFFFL;
        int end = data.length - CRC_BYTES;
        if (count * MIN_RECORD_BYTES > end - PREAMBLE_BYTES) {
            throw Frames.truncated(count + " tensors cannot fit in " + (end - PREAMBLE_BYTES)
                    + " bytes");
        }
        Frames.checkCrc(in, data, end);
        long limit = Math.min(SparseTensor.MAX_NUMEL, maxNumel);
        Map<String, SignsTensor> tensors = new LinkedHashMap<>();
        int pos = PREAMBLE_BYTES;
        for (long k = 0; k < count; k++) {
            Frames.need(pos, 2, end, "tensor name length");
            int nameLen = in.getShort(pos) & 0xFFFF;
            pos += 2;
            Frames.need(pos, nameLen, end, "tensor name");
            String name = Frames.name(data, pos, nameLen, "tensor name");
            pos += nameLen;
            if (tensors.containsKey(name)) {
                throw new DecodeException(DecodeException.Reason.DUPLICATE_NAME,
                        "tensor '" + name + "' appears twice");
            }
            Frames.need(pos, 1, end, "ndim of '" + name + "'");
            int ndim = data[pos] & 0xFF;
            pos += 1;
            long[] shape = new long[ndim];
            long numel = 1;
            for (int d = 0; d < ndim; d++) {
                Frames.need(pos, 8, end, "dims of '" + name + "'");
                long dim = in.getLong(pos);
                pos += 8;
                // numel * dim > limit, exactly (limit <= 2^62, so the product never overflows
                // when it is not above it).
                if (Long.compareUnsigned(dim, SparseTensor.MAX_NUMEL) > 0
                        || (numel != 0 && dim > limit / numel)) {
                    throw new DecodeException(DecodeException.Reason.TOO_LARGE, "tensor '"
                            + name + "' claims more entries than the bound " + limit);
                }
                shape[d] = dim;
                numel *= dim;
            }
            Frames.need(pos, 4, end, "scale of '" + name + "'");
            int scaleBits = in.getInt(pos);
            pos += 4;
            if ((scaleBits & 0x7F800000) == 0x7F800000) {
                throw new DecodeException(DecodeException.Reason.NON_FINITE_VALUE, "tensor '"
                        + name + "': its scale is NaN or Inf");
            }
            if (scaleBits < 0) {
                throw new DecodeException(DecodeException.Reason.BAD_VALUE_SECTION, "tensor '"
                        + name + "': its scale is negative");
            }
            long nbytes = (numel + 7) / 8;
            if (pos + nbytes > end) {
                throw Frames.truncated("the signs of '" + name + "' need " + nbytes
                        + " bytes at offset " + pos);
            }
            byte[] signs = new byte[(int) nbytes];
            System.arraycopy(data, pos, signs, 0, (int) nbytes);
            pos += (int) nbytes;
            if (numel % 8 != 0 && (signs[signs.length - 1] & 0xFF) >>> (int) (numel % 8) != 0) {
                throw new DecodeException(DecodeException.Reason.BAD_VALUE_SECTION, "tensor '"
                        + name + "': the padding after its last sign is not zero");
            }
            tensors.put(name, new SignsTensor(shape, Float.intBitsToFloat(scaleBits), signs));
        }
        if (pos != end) {
            throw new DecodeException(DecodeException.Reason.TRAILING, "trailing or oversized "
                    + "input: " + (end - pos) + " bytes after the last tensor");
        }
        return new SignsUpdate(tensors, sequence);
    }
}
