package org.fedgc.wire;

import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.CharacterCodingException;
import java.nio.charset.CodingErrorAction;
import java.nio.charset.StandardCharsets;
import java.util.zip.CRC32;

/**
 * Checks shared by this package's framed decoders ({@link SignsCodec}, {@link RankRequest},
 * {@link SharedMask}, {@link CompactCodec}): a magic-versioned preamble, length-prefixed utf-8
 * names, a trailing crc32 of everything before it.
 * Their messages are the Python decoders' (the same-verdict tests compare the reasons).
 */
final class Frames {
    private Frames() {
    }

    /** Throws {@code TRUNCATED} unless {@code size} bytes from {@code pos} end by {@code end}. */
    static void need(int pos, long size, int end, String what) throws DecodeException {
        if (pos + size > end) {
            throw truncated(what + " needs " + size + " bytes at offset " + pos + ", only "
                    + Math.max(end - pos, 0) + " left before the checksum");
        }
    }

    /** Whether {@code data} starts with the 4-byte {@code magic}. */
    static boolean hasMagic(byte[] data, byte[] magic) {
        return data != null && data.length >= 4 && data[0] == magic[0] && data[1] == magic[1]
                && data[2] == magic[2] && data[3] == magic[3];
    }

    /**
     * The preamble's checks, in the Python decoders' order: at least {@code minBytes}
     * ({@code TRUNCATED}, "{@code minBytes} bytes, {@code message} has at least ..."), the
     * magic ({@code BAD_MAGIC}, "expected {@code expected}"), the version byte after it
     * ({@code UNSUPPORTED_VERSION}); {@code data} little-endian for the fields after them.
     */
    static ByteBuffer preamble(byte[] data, byte[] magic, int version, int minBytes,
                               String message, String expected) throws DecodeException {
        if (data == null || data.length < minBytes) {
            throw truncated((data == null ? 0 : data.length) + " bytes, " + message
                    + " has at least " + minBytes);
        }
        if (!hasMagic(data, magic)) {
            throw new DecodeException(DecodeException.Reason.BAD_MAGIC,
                    "bad magic, expected " + expected);
        }
        if ((data[4] & 0xFF) != version) {
            throw new DecodeException(DecodeException.Reason.UNSUPPORTED_VERSION,
                    "unsupported version " + (data[4] & 0xFF) + ", this decoder reads " + version);
        }
        return ByteBuffer.wrap(data).order(ByteOrder.LITTLE_ENDIAN);
    }

    static DecodeException truncated(String detail) {
        return new DecodeException(DecodeException.Reason.TRUNCATED, "truncated input: " + detail);
    }

    /** Throws {@code BAD_CHECKSUM} unless the crc32 at {@code end} is that of the bytes before. */
    static void checkCrc(ByteBuffer in, byte[] data, int end) throws DecodeException {
        CRC32 crc = new CRC32();
        crc.update(data, 0, end);
        long stored = in.getInt(end) & 0xFFFFFFFFL;
        if (stored != crc.getValue()) {
            throw new DecodeException(DecodeException.Reason.BAD_CHECKSUM, String.format(
                    "bad checksum: stored 0x%08x, computed 0x%08x", stored, crc.getValue()));
        }
    }

    /** The strict utf-8 name of {@code len} bytes at {@code pos}; else {@code BAD_UTF8}. */
    static String name(byte[] data, int pos, int len, String what) throws DecodeException {
        try {
            return StandardCharsets.UTF_8.newDecoder()
                    .onMalformedInput(CodingErrorAction.REPORT)
                    .onUnmappableCharacter(CodingErrorAction.REPORT)
                    .decode(ByteBuffer.wrap(data, pos, len)).toString();
        } catch (CharacterCodingException ex) {
            throw new DecodeException(DecodeException.Reason.BAD_UTF8,
                    what + " is not valid utf-8");
        }
    }
}
