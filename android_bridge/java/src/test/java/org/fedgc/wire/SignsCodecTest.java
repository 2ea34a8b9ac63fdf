package org.fedgc.wire;

import java.io.ByteArrayOutputStream;
import java.math.BigInteger;
import java.nio.ByteBuffer;
import java.nio.ByteOrder;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.zip.CRC32;

/**
 * The test driver of {@link SignsCodec} (plain main, no JUnit): the golden vectors of the
 * {@code signs} payload kind in both directions, every prefix and single-bit flip of them, and a
 * crafted message with a valid checksum for each rejection. Usage:
 * {@code java org.fedgc.wire.SignsCodecTest tests/golden/payloads/signs.json}. Prints one line
 * per failed check and a summary; exits 1 when anything failed.
 */
public final class SignsCodecTest {
    private static int checks;
    private static final List<String> failures = new ArrayList<>();

    private SignsCodecTest() {
    }

    public static void main(String[] args) throws Exception {
        if (args.length != 1) {
            System.err.println("usage: SignsCodecTest SIGNS_GOLDEN_JSON");
            System.exit(2);
        }
        String json = new String(Files.readAllBytes(Paths.get(args[0])), StandardCharsets.UTF_8);
        @SuppressWarnings("unchecked")
        Map<String, Object> doc = (Map<String, Object>) MiniJson.parse(json);
        check("signs".equals(doc.get("kind")), "the golden file is of kind signs");
        @SuppressWarnings("unchecked")
        List<Object> cases = (List<Object>) doc.get("cases");
        check(cases.size() >= 3, "golden file holds at least 3 cases, got " + cases.size());
        for (Object c : cases) {
            @SuppressWarnings("unchecked")
            Map<String, Object> m = (Map<String, Object>) c;
            byte[] data = goldenCase(m);
            damagedMessages((String) m.get("case"), data);
        }
        craftedRejections();
        for (String f : failures) {
            System.out.println("FAIL " + f);
        }
        System.out.println((failures.isEmpty() ? "OK " : "FAILED ") + (checks - failures.size())
                + "/" + checks + " checks passed");
        System.exit(failures.isEmpty() ? 0 : 1);
    }

    /** Decode to the recorded content; encode the recorded content to the recorded bytes. */
    @SuppressWarnings("unchecked")
    private static byte[] goldenCase(Map<String, Object> m) throws DecodeException {
        String name = (String) m.get("case");
        byte[] data = WireCodecTest.unhex((String) m.get("hex"));
        check(data.length == ((BigInteger) m.get("bytes")).intValue(), name + ": length");
        long sequence = ((BigInteger) m.get("sequence")).longValue(); // low 64 bits = unsigned
        List<Object> parts = (List<Object>) m.get("parts");
        check(parts.size() == 1, name + ": one part");
        Map<String, SignsTensor> expected = new LinkedHashMap<>();
        for (Object o : (List<Object>) parts.get(0)) {
            Map<String, Object> t = (Map<String, Object>) o;
            long[] shape = longs((List<Object>) t.get("shape"));
            long[] indices = longs((List<Object>) t.get("indices"));
            long[] bits = longs((List<Object>) t.get("value_bits"));
            check("float32".equals(t.get("dtype")), name + ": float32 values");
            float[] values = new float[bits.length];
            for (int j = 0; j < bits.length; j++) {
                check(indices[j] == j, name + ": every entry, in order");
                values[j] = Float.intBitsToFloat((int) bits[j]);
            }
            float scale = bits.length == 0 ? 0f : Math.abs(values[0]);
            expected.put((String) t.get("name"), SignsTensor.ofSigns(shape, scale, values));
        }
        SignsUpdate want = new SignsUpdate(expected, sequence);
        SignsUpdate got = SignsCodec.decode(data, SparseTensor.MAX_NUMEL);
        check(got.equals(want), name + ": decodes to " + got + ", recorded " + want);
        for (Map.Entry<String, SignsTensor> e : got.tensors().entrySet()) {
            Map<String, Object> t = null;
            for (Object o : (List<Object>) parts.get(0)) {
                if (e.getKey().equals(((Map<String, Object>) o).get("name"))) {
                    t = (Map<String, Object>) o;
                }
            }
            long[] bits = longs((List<Object>) t.get("value_bits"));
            for (int j = 0; j < bits.length; j++) {
                check((Float.floatToRawIntBits(e.getValue().value(j)) & 0xFFFFFFFFL) == bits[j],
                        name + ": value bits of " + e.getKey() + "[" + j + "]");
            }
        }
        byte[] encoded = SignsCodec.encode(want);
        check(Arrays.equals(encoded, data), name + ": encodes to " + WireCodecTest.hex(encoded)
                + ", recorded " + WireCodecTest.hex(data));
        return data;
    }

    private static void damagedMessages(String name, byte[] data) {
        for (int n = 0; n < data.length; n++) {
            check(rejection(Arrays.copyOf(data, n)) != null, name + ": prefix of " + n
                    + " bytes accepted");
        }
        check(rejection(Arrays.copyOf(data, data.length + 1)) != null, name + ": a byte appended");
        int accepted = 0;
        for (int i = 0; i < data.length; i++) {
            for (int bit = 0; bit < 8; bit++) {
                byte[] flipped = data.clone();
                flipped[i] ^= (byte) (1 << bit);
                if (rejection(flipped) == null) {
                    accepted++;
                }
            }
        }
        check(accepted == 0, name + ": " + accepted + " single-bit flips accepted");
        byte[] magic = data.clone();
        magic[3] = 'U';
        expect(magic, DecodeException.Reason.BAD_MAGIC, name + ": magic FGCU");
        byte[] version = data.clone();
        version[4] = 2;
        expect(version, DecodeException.Reason.UNSUPPORTED_VERSION, name + ": version 2");
    }

    /** A message built field by field with a valid checksum. */
    private static final class Raw {
        private final ByteArrayOutputStream body = new ByteArrayOutputStream();
        private int tensors;

        Raw tensor(byte[] name, long[] shape, int scaleBits, byte[] signs) {
            ByteBuffer b = ByteBuffer.allocate(2 + name.length + 1 + 8 * shape.length + 4)
                    .order(ByteOrder.LITTLE_ENDIAN);
            b.putShort((short) name.length).put(name).put((byte) shape.length);
            for (long d : shape) {
                b.putLong(d);
            }
            b.putInt(scaleBits);
            body.writeBytes(b.array());
            body.writeBytes(signs);
            tensors++;
            return this;
        }

        Raw tensor(String name, long[] shape, float scale, byte[] signs) {
            return tensor(name.getBytes(StandardCharsets.UTF_8), shape,
                    Float.floatToRawIntBits(scale), signs);
        }

        byte[] build() {
            return build(tensors, new byte[0]);
        }

        byte[] build(long count, byte[] extra) {
            ByteBuffer head = ByteBuffer.allocate(17).order(ByteOrder.LITTLE_ENDIAN);
            head.put(SignsCodec.MAGIC).put((byte) 1).putLong(1).putInt((int) count);
            ByteArrayOutputStream all = new ByteArrayOutputStream();
            all.writeBytes(head.array());
            all.writeBytes(body.toByteArray());
            all.writeBytes(extra);
            byte[] b = all.toByteArray();
            CRC32 crc = new CRC32();
            crc.update(b);
            return ByteBuffer.allocate(b.length + 4).order(ByteOrder.LITTLE_ENDIAN).put(b)
                    .putInt((int) crc.getValue()).array();
        }
    }

    private static void craftedRejections() throws DecodeException {
        long[] s10 = {10};
        byte[] two = {0, 0};
        SignsUpdate ok = SignsCodec.decode(new Raw().tensor("w", s10, 0.5f, new byte[]{6, 1})
                .build(), 10);
        check(ok.tensors().get("w").negative(1) && ok.tensors().get("w").negative(8)
                && !ok.tensors().get("w").negative(0), "a crafted message decodes");
        expect(new Raw().tensor("w", new long[]{1L << 40}, 1f, new byte[0]).build(),
                DecodeException.Reason.TOO_LARGE, "a tensor above the bound", 1L << 20);
        expect(new Raw().tensor("w", new long[]{(1L << 62) + 1}, 1f, new byte[0]).build(),
                DecodeException.Reason.TOO_LARGE, "a dim above 2^62", Long.MAX_VALUE);
        expect(new Raw().tensor("w", s10, 1f, new byte[]{0}).build(),
                DecodeException.Reason.TRUNCATED, "signs past the checksum");
        expect(new Raw().tensor("w", s10, -1f, two).build(),
                DecodeException.Reason.BAD_VALUE_SECTION, "a negative scale");
        expect(new Raw().tensor("w", s10, -0f, two).build(),
                DecodeException.Reason.BAD_VALUE_SECTION, "a scale of -0.0");
        expect(new Raw().tensor("w", s10, Float.NaN, two).build(),
                DecodeException.Reason.NON_FINITE_VALUE, "a NaN scale");
        expect(new Raw().tensor("w", s10, Float.NEGATIVE_INFINITY, two).build(),
                DecodeException.Reason.NON_FINITE_VALUE, "an infinite scale");
        expect(new Raw().tensor("w", s10, 1f, new byte[]{0, 4}).build(),
                DecodeException.Reason.BAD_VALUE_SECTION, "a padding bit set");
        expect(new Raw().tensor("w", s10, 1f, two).tensor("w", s10, 1f, two).build(),
                DecodeException.Reason.DUPLICATE_NAME, "a name twice");
        expect(new Raw().tensor(new byte[]{(byte) 0xC3, 0x28}, s10,
                Float.floatToRawIntBits(1f), two).build(),
                DecodeException.Reason.BAD_UTF8, "a name that is not UTF-8");
        expect(new Raw().tensor("w", s10, 1f, two).build(1, new byte[]{0}),
                DecodeException.Reason.TRAILING, "a byte after the last tensor");
        expect(new Raw().build(1L << 31, new byte[0]), DecodeException.Reason.TRUNCATED,
                "2^31 tensors in no bytes");
        try {
            new SignsTensor(s10, 1f, new byte[]{0, 4});
            check(false, "a tensor with a padding bit set is refused");
        } catch (IllegalArgumentException e) {
            check(true, "a tensor with a padding bit set is refused");
        }
    }

    private static DecodeException.Reason rejection(byte[] data) {
        return rejection(data, SparseTensor.MAX_NUMEL);
    }

    private static DecodeException.Reason rejection(byte[] data, long maxNumel) {
        try {
            SignsCodec.decode(data, maxNumel);
            return null;
        } catch (DecodeException e) {
            return e.reason();
        } catch (RuntimeException e) {
            check(false, "decode threw " + e + " instead of DecodeException");
            return null;
        }
    }

    private static void expect(byte[] data, DecodeException.Reason want, String what) {
        expect(data, want, what, SparseTensor.MAX_NUMEL);
    }

    private static void expect(byte[] data, DecodeException.Reason want, String what,
                               long maxNumel) {
        DecodeException.Reason got = rejection(data, maxNumel);
        check(got == want, what + ": got " + got + ", expected " + want);
    }

    private static void check(boolean ok, String what) {
        checks++;
        if (!ok) {
            failures.add(what);
        }
    }

    private static long[] longs(List<Object> list) {
        long[] out = new long[list.size()];
        for (int i = 0; i < out.length; i++) {
            out[i] = ((BigInteger) list.get(i)).longValue();
        }
        return out;
    }
}
