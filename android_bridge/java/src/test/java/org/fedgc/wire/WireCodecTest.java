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
import java.util.Random;
import java.util.zip.CRC32;

/**
 * The Java codec's test driver (plain main, no JUnit): golden vectors in both directions,
 * rejections of damaged and crafted messages, encoder refusals, the Rice parameter rule and the
 * half-float conversions. Usage: {@code java org.fedgc.wire.WireCodecTest tests/golden/wire_v1.json}.
 * Prints one line per failed check and a summary; exits 1 when anything failed.
 */
public final class WireCodecTest {
    private static int checks;
    private static final List<String> failures = new ArrayList<>();

    /** The floats wire_golden.py builds its "spread" tensors from (inputs, not results). */
    private static final double[] SPREAD_VALUES = {0.5, -1.25, 3.0, -0.0, 1e-3, 65504.0, -2.0, 0.1,
        7.75};

    private WireCodecTest() {
    }

    public static void main(String[] args) throws Exception {
        if (args.length != 1) {
            System.err.println("usage: WireCodecTest GOLDEN_JSON");
            System.exit(2);
        }
        String json = new String(Files.readAllBytes(Paths.get(args[0])), StandardCharsets.UTF_8);
        @SuppressWarnings("unchecked")
        List<Object> cases = (List<Object>) ((Map<String, Object>) MiniJson.parse(json))
                .get("cases");
        check(cases.size() >= 7, "golden file holds at least 7 cases, got " + cases.size());
        Map<String, byte[]> golden = new LinkedHashMap<>();
        for (Object c : cases) {
            @SuppressWarnings("unchecked")
            Map<String, Object> m = (Map<String, Object>) c;
            golden.put((String) m.get("case"), goldenCase(m));
        }
        for (Map.Entry<String, byte[]> e : golden.entrySet()) {
            damagedMessages(e.getKey(), e.getValue());
        }
        goldenValueConversions(cases);
        craftedRejections();
        encoderRefusals();
        riceParameterIsSmallestMinimiser();
        randomRoundTrips();
        halfFloatRoundTrips();
        for (String f : failures) {
            System.out.println("FAIL " + f);
        }
        System.out.println((failures.isEmpty() ? "OK " : "FAILED ") + (checks - failures.size())
                + "/" + checks + " checks passed");
        System.exit(failures.isEmpty() ? 0 : 1);
    }

    // ------------------------------------------------------------------------------------------
    // Golden vectors
    // ------------------------------------------------------------------------------------------

    /** Decode to the recorded content, encode the recorded content to the recorded bytes. */
    @SuppressWarnings("unchecked")
    private static byte[] goldenCase(Map<String, Object> m) throws DecodeException {
        String name = (String) m.get("case");
        byte[] data = unhex((String) m.get("hex"));
        check(data.length == ((BigInteger) m.get("bytes")).intValue(), name + ": length");
        long sequence = ((BigInteger) m.get("sequence")).longValue(); // low 64 bits = unsigned
        IndexCoding argument = IndexCoding.fromName((String) m.get("index_coding_argument"));
        Map<String, SparseTensor> expected = new LinkedHashMap<>();
        Map<String, IndexCoding> expectedCodings = new LinkedHashMap<>();
        for (Object o : (List<Object>) m.get("tensors")) {
            Map<String, Object> t = (Map<String, Object>) o;
            long[] shape = longs((List<Object>) t.get("shape"));
            long[] indices = longs((List<Object>) t.get("indices"));
            long[] bitsLong = longs((List<Object>) t.get("value_bits"));
            int[] bits = new int[bitsLong.length];
            for (int i = 0; i < bits.length; i++) {
                bits[i] = (int) bitsLong[i];
            }
            ValueDtype dtype = ValueDtype.fromName((String) t.get("dtype"));
            expected.put((String) t.get("name"), SparseTensor.ofRawBits(shape, indices, dtype, bits));
            expectedCodings.put((String) t.get("name"),
                    IndexCoding.fromName((String) t.get("index_coding")));
        }
        SparseUpdate want = new SparseUpdate(expected, sequence);

        SparseUpdate got = WireCodec.decode(data);
        check(got.sequence() == sequence, name + ": sequence " + Long.toUnsignedString(
                got.sequence()) + " != " + Long.toUnsignedString(sequence));
        check(new ArrayList<>(got.tensors().keySet()).equals(new ArrayList<>(expected.keySet())),
                name + ": names in order " + got.tensors().keySet());
        for (Map.Entry<String, SparseTensor> e : expected.entrySet()) {
            SparseTensor g = got.tensors().get(e.getKey());
            SparseTensor w = e.getValue();
            check(g != null && Arrays.equals(g.shape(), w.shape()), name + "/" + e.getKey()
                    + ": shape");
            check(g != null && g.dtype() == w.dtype(), name + "/" + e.getKey() + ": dtype");
            check(g != null && Arrays.equals(g.indices(), w.indices()), name + "/" + e.getKey()
                    + ": indices");
            check(g != null && g.equals(w), name + "/" + e.getKey() + ": value bits");
        }
        check(got.equals(want), name + ": decoded update equals the recorded content");
        check(WireCodec.tensorCodings(data).equals(expectedCodings), name + ": stored codings "
                + WireCodec.tensorCodings(data) + " != " + expectedCodings);
        checkBytes(WireCodec.encode(want, argument), data, name + ": encode(recorded content, "
                + argument + ")");
        checkBytes(WireCodec.encode(got, argument), data, name + ": encode(decode(hex))");
        return data;
    }

    /** The spread floats, rounded by HalfFloats, give the golden value bits of each dtype. */
    @SuppressWarnings("unchecked")
    private static void goldenValueConversions(List<Object> cases) {
        for (Object c : cases) {
            Map<String, Object> m = (Map<String, Object>) c;
            String name = (String) m.get("case");
            if (!name.equals("golomb_fp16") && !name.equals("raw_fp32")
                    && !name.equals("bitmap_bf16")) {
                continue;
            }
            Map<String, Object> t = (Map<String, Object>) ((List<Object>) m.get("tensors")).get(0);
            long[] bits = longs((List<Object>) t.get("value_bits"));
            ValueDtype dtype = ValueDtype.fromName((String) t.get("dtype"));
            for (int i = 0; i < SPREAD_VALUES.length; i++) {
                float f = (float) SPREAD_VALUES[i];
                long mine = dtype == ValueDtype.FLOAT32 ? Float.floatToRawIntBits(f) & 0xFFFFFFFFL
                        : dtype == ValueDtype.FLOAT16 ? HalfFloats.floatToFloat16(f) & 0xFFFF
                        : HalfFloats.floatToBfloat16(f) & 0xFFFF;
                check(mine == bits[i], name + ": value " + SPREAD_VALUES[i] + " as " + dtype
                        + " gives 0x" + Long.toHexString(mine) + ", golden 0x"
                        + Long.toHexString(bits[i]));
            }
        }
    }

    /** Truncation, padding, every single-bit flip, and the header fields named by reason. */
    private static void damagedMessages(String name, byte[] data) {
        for (int n = 0; n < data.length; n++) {
            byte[] prefix = Arrays.copyOf(data, n);
            DecodeException.Reason r = rejection(prefix);
            check(r != null, name + ": prefix of " + n + " bytes accepted");
            if (n < WireCodec.EMPTY_MESSAGE_BYTES) {
                check(r == DecodeException.Reason.TRUNCATED, name + ": prefix of " + n
                        + " bytes gives " + r + ", expected TRUNCATED");
            }
        }
        byte[] longer = Arrays.copyOf(data, data.length + 1);
        check(rejection(longer) == DecodeException.Reason.TRAILING, name + ": a byte appended");
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
        expectReason(withByte(data, 0, 'G'), DecodeException.Reason.BAD_MAGIC, name + ": magic");
        expectReason(withByte(data, 4, 2), DecodeException.Reason.UNSUPPORTED_VERSION,
                name + ": version 2");
        expectReason(withByte(data, 5, 1), DecodeException.Reason.UNSUPPORTED_FLAGS,
                name + ": flags 1");
        expectReason(withByte(data, data.length - 1, data[data.length - 1] ^ 0x80),
                DecodeException.Reason.BAD_CHECKSUM, name + ": stored checksum");
        if (data.length > 26) {
            // A payload byte changed: the header walk may still succeed, the CRC cannot.
            byte[] mutated = withByte(data, data.length - 5, data[data.length - 5] ^ 0x01);
            expectReason(mutated, DecodeException.Reason.BAD_CHECKSUM, name + ": last value byte");
        }
    }

    // ------------------------------------------------------------------------------------------
    // Crafted messages with valid checksums
    // ------------------------------------------------------------------------------------------

    /** A message built field by field, for faults an encoder would never write. */
    static final class Raw {
        private final ByteArrayOutputStream body = new ByteArrayOutputStream();
        private int tensors;
        private final long sequence;

        Raw(long sequence) {
            this.sequence = sequence;
        }

        Raw tensor(byte[] name, long[] shape, long count, int coding, int dtype, byte[] section,
                   byte[] values) {
            ByteBuffer b = ByteBuffer.allocate(2 + name.length + 1 + 8 * shape.length + 18)
                    .order(ByteOrder.LITTLE_ENDIAN);
            b.putShort((short) name.length).put(name).put((byte) shape.length);
            for (long d : shape) {
                b.putLong(d);
            }
            b.putLong(count).put((byte) coding).put((byte) dtype).putLong(section.length);
            body.writeBytes(b.array());
            body.writeBytes(section);
            body.writeBytes(values);
            tensors++;
            return this;
        }

        Raw tensor(String name, long[] shape, long count, int coding, int dtype, byte[] section,
                   byte[] values) {
            return tensor(name.getBytes(StandardCharsets.UTF_8), shape, count, coding, dtype,
                    section, values);
        }

        byte[] build() {
            return build(tensors);
        }

        byte[] build(long tensorCount) {
            ByteBuffer head = ByteBuffer.allocate(18).order(ByteOrder.LITTLE_ENDIAN);
            head.put(WireCodec.MAGIC).put((byte) 1).put((byte) 0).putLong(sequence)
                    .putInt((int) tensorCount);
            return withCrc(concat(head.array(), body.toByteArray()));
        }
    }

    private static void craftedRejections() throws DecodeException {
        final int raw = 1;
        final int bitmap = 2;
        final int golomb = 3;
        final int f32 = 0;
        final int f16 = 1;
        long[] s10 = {10};
        byte[] one = f32s(1.0f);
        byte[] two = f32s(1.0f, 2.0f);

        // A valid baseline, so that each fault below is the only thing wrong.
        check(rejection(new Raw(7).tensor("w", s10, 2, raw, f32, u32s(3, 5), two).build()) == null,
                "crafted baseline is accepted");

        expectReason(new Raw(7).tensor("w", s10, 2, raw, f32, u32s(5, 3), two).build(),
                DecodeException.Reason.INDEX_NOT_INCREASING, "raw indices unsorted");
        expectReason(new Raw(7).tensor("w", s10, 2, raw, f32, u32s(4, 4), two).build(),
                DecodeException.Reason.INDEX_NOT_INCREASING, "raw index repeated");
        expectReason(new Raw(7).tensor("w", s10, 2, raw, f32, u32s(3, 10), two).build(),
                DecodeException.Reason.INDEX_OUT_OF_RANGE, "raw index == numel");
        expectReason(new Raw(7).tensor("w", s10, 1, raw, f32, u32s(3, 4), one).build(),
                DecodeException.Reason.BAD_INDEX_SECTION, "raw section length");
        expectReason(new Raw(7).tensor("w", s10, 1, raw, f32, u32s(3), f32s(Float.NaN)).build(),
                DecodeException.Reason.NON_FINITE_VALUE, "float32 NaN");
        expectReason(new Raw(7).tensor("w", s10, 1, raw, f32, u32s(3),
                f32s(Float.NEGATIVE_INFINITY)).build(), DecodeException.Reason.NON_FINITE_VALUE,
                "float32 -Inf");
        expectReason(new Raw(7).tensor("w", s10, 1, raw, f16, u32s(3), u16s(0x7C00)).build(),
                DecodeException.Reason.NON_FINITE_VALUE, "float16 Inf");
        expectReason(new Raw(7).tensor("w", s10, 1, raw, 2, u32s(3), u16s(0xFFC1)).build(),
                DecodeException.Reason.NON_FINITE_VALUE, "bfloat16 NaN");
        expectReason(new Raw(7).tensor("w", s10, 1, 4, f32, u32s(3), one).build(),
                DecodeException.Reason.UNKNOWN_CODING, "index coding 4");
        expectReason(new Raw(7).tensor("w", s10, 1, raw, 3, u32s(3), one).build(),
                DecodeException.Reason.UNKNOWN_DTYPE, "value dtype 3");
        expectReason(new Raw(7).tensor("w", s10, 11, raw, f32, new byte[0], new byte[0]).build(),
                DecodeException.Reason.COUNT_ABOVE_NUMEL, "count 11 of 10");
        expectReason(new Raw(7).tensor("w", s10, 9, 0, f32, new byte[0], new byte[36]).build(),
                DecodeException.Reason.BAD_INDEX_SECTION, "coding all on 9 of 10");
        expectReason(new Raw(7).tensor("w", s10, 10, 0, f32, u32s(0), new byte[40]).build(),
                DecodeException.Reason.BAD_INDEX_SECTION, "coding all with index bytes");
        expectReason(new Raw(7).tensor("w", s10, 1, raw, f32, u32s(3), one)
                .tensor("w", s10, 1, raw, f32, u32s(4), one).build(),
                DecodeException.Reason.DUPLICATE_NAME, "duplicate name");
        for (byte[] badName : new byte[][] {{(byte) 0xFF}, {(byte) 0xC0, (byte) 0xAF},
            {(byte) 0xED, (byte) 0xA0, (byte) 0x80}, {(byte) 0xE4, (byte) 0xB8}}) {
            expectReason(new Raw(7).tensor(badName, s10, 1, raw, f32, u32s(3), one).build(),
                    DecodeException.Reason.BAD_UTF8, "name bytes " + hex(badName));
        }
        expectReason(new Raw(7).tensor("w", new long[] {(1L << 62) + 1}, 0, raw, f32, new byte[0],
                new byte[0]).build(), DecodeException.Reason.TOO_LARGE, "dim 2^62 + 1");
        expectReason(new Raw(7).tensor("w", new long[] {1L << 31, 1L << 32}, 0, raw, f32,
                new byte[0], new byte[0]).build(), DecodeException.Reason.TOO_LARGE,
                "numel 2^63");
        expectReason(new Raw(7).tensor("w", new long[] {-1L}, 0, raw, f32, new byte[0],
                new byte[0]).build(), DecodeException.Reason.TOO_LARGE, "dim 2^64 - 1");
        SparseUpdate zero = WireCodec.decode(new Raw(7).tensor("w", new long[] {1L << 62,
            1L << 62, 0}, 0, 0, f32, new byte[0], new byte[0]).build());
        check(zero.tensors().get("w").numel() == 0, "a zero dim makes numel 0 after huge dims");
        byte[] big = new Raw(7).tensor("w", new long[] {1000, 1000}, 1, raw, f32, u32s(3), one)
                .build();
        check(rejection(big) == null, "10^6 entries accepted without maxNumel");
        try {
            WireCodec.decode(big, 999_999);
            check(false, "maxNumel 999999 accepts a 10^6 tensor");
        } catch (DecodeException e) {
            check(e.reason() == DecodeException.Reason.TOO_LARGE, "maxNumel gives " + e.reason());
        }
        expectReason(new Raw(7).tensor("w", new long[] {1L << 61}, 1L << 60, raw, f32,
                new byte[0], new byte[0]).build(), DecodeException.Reason.TRUNCATED,
                "count 2^60 without the bytes (no allocation)");
        expectReason(new Raw(7).tensor("w", s10, 1, raw, f32, u32s(3), one).build(1L << 31),
                DecodeException.Reason.TRUNCATED, "tensor count 2^31");
        expectReason(new Raw(7).build(0xFFFFFFFFL), DecodeException.Reason.TRUNCATED,
                "tensor count 2^32 - 1");

        // Bitmap: 10 entries in 2 bytes, bits 10..15 are padding.
        check(rejection(new Raw(7).tensor("w", s10, 2, bitmap, f32, bytes(0x28, 0x00), two).build())
                == null, "bitmap baseline accepted");
        expectReason(new Raw(7).tensor("w", s10, 2, bitmap, f32, bytes(0x28, 0x80), two).build(),
                DecodeException.Reason.BAD_INDEX_SECTION, "bitmap padding bit");
        expectReason(new Raw(7).tensor("w", s10, 2, bitmap, f32, bytes(0x29, 0x00), two).build(),
                DecodeException.Reason.BAD_INDEX_SECTION, "bitmap with 3 ones for count 2");
        expectReason(new Raw(7).tensor("w", s10, 2, bitmap, f32, bytes(0x28), two).build(),
                DecodeException.Reason.BAD_INDEX_SECTION, "bitmap of 1 byte for 10 entries");

        // Golomb-Rice, b = 1, indices 3 and 5: gaps 3, 1 -> remainders 1, 1 (bits 0b11),
        // quotients 1, 0 -> unary 0 1 1 = 0b110.
        byte[] good = bytes(1, 0x03, 0x06);
        SparseUpdate g = WireCodec.decode(new Raw(7).tensor("w", s10, 2, golomb, f32, good, two)
                .build());
        check(Arrays.equals(g.tensors().get("w").indices(), new long[] {3, 5}),
                "golomb baseline decodes to 3, 5: " + Arrays.toString(g.tensors().get("w")
                .indices()));
        expectReason(new Raw(7).tensor("w", s10, 2, golomb, f32, bytes(63, 0x03, 0x06), two)
                .build(), DecodeException.Reason.BAD_INDEX_SECTION, "Rice parameter 63");
        expectReason(new Raw(7).tensor("w", s10, 2, golomb, f32, bytes(1, 0x03, 0x06, 0x00), two)
                .build(), DecodeException.Reason.BAD_INDEX_SECTION, "unary trailing zero byte");
        expectReason(new Raw(7).tensor("w", s10, 2, golomb, f32, bytes(1, 0x03, 0x07), two)
                .build(), DecodeException.Reason.BAD_INDEX_SECTION, "three unary codes for 2");
        expectReason(new Raw(7).tensor("w", s10, 2, golomb, f32, bytes(1, 0x07, 0x06), two)
                .build(), DecodeException.Reason.BAD_INDEX_SECTION, "remainder padding bit");
        expectReason(new Raw(7).tensor("w", s10, 0, golomb, f32, new byte[0], new byte[0])
                .build(), DecodeException.Reason.BAD_INDEX_SECTION, "missing parameter byte");
        expectReason(new Raw(7).tensor("w", s10, 2, golomb, f32, bytes(40, 0x03), two)
                .build(), DecodeException.Reason.BAD_INDEX_SECTION, "section shorter than "
                + "its remainders");
        // b = 0, unary 0^10 1 -> gap 10 in a tensor of 10.
        expectReason(new Raw(7).tensor("w", s10, 1, golomb, f32, bytes(0, 0x00, 0x04), one)
                .build(), DecodeException.Reason.INDEX_OUT_OF_RANGE, "gap 10 of 10");
        // b = 0, gaps 5, 4 -> indices 5, 10 of 10.
        expectReason(new Raw(7).tensor("w", s10, 2, golomb, f32, bytes(0, 0x20, 0x04), two)
                .build(), DecodeException.Reason.INDEX_OUT_OF_RANGE, "index 10 of 10");
    }

    private static void encoderRefusals() {
        long[] s10 = {10};
        expectRefusal(update("w", SparseTensor.ofFloat32(s10, new long[] {5, 3},
                new float[] {1, 2})), IndexCoding.AUTO, "unsorted indices");
        expectRefusal(update("w", SparseTensor.ofFloat32(s10, new long[] {3, 3},
                new float[] {1, 2})), IndexCoding.AUTO, "repeated indices");
        expectRefusal(update("w", SparseTensor.ofFloat32(s10, new long[] {10},
                new float[] {1})), IndexCoding.AUTO, "index == numel");
        expectRefusal(update("w", SparseTensor.ofFloat32(s10, new long[] {-1},
                new float[] {1})), IndexCoding.AUTO, "negative index");
        expectRefusal(update("w", SparseTensor.ofFloat32(s10, new long[] {1},
                new float[] {Float.NaN})), IndexCoding.AUTO, "NaN value");
        expectRefusal(update("w", SparseTensor.ofBits16(s10, new long[] {1}, ValueDtype.FLOAT16,
                new short[] {(short) 0xFC00})), IndexCoding.AUTO, "float16 -Inf");
        expectRefusal(update("w", SparseTensor.ofFloat32(s10, new long[] {1},
                new float[] {1})), IndexCoding.ALL, "ALL on a sparse tensor");
        expectRefusal(update("w", SparseTensor.ofFloat32(new long[] {1L << 33}, new long[] {1},
                new float[] {1})), IndexCoding.RAW, "RAW beyond 2^32 entries");
        expectRefusal(update("w", SparseTensor.ofFloat32(new long[] {1L << 40}, new long[] {1},
                new float[] {1})), IndexCoding.BITMAP, "a bitmap beyond a Java array");
        expectRefusal(update("bad\uD800name", SparseTensor.ofFloat32(s10, new long[] {1},
                new float[] {1})), IndexCoding.AUTO, "unpaired surrogate in a name");
        char[] longName = new char[65536];
        Arrays.fill(longName, 'x');
        expectRefusal(update(new String(longName), SparseTensor.ofFloat32(s10, new long[] {1},
                new float[] {1})), IndexCoding.AUTO, "a name of 65536 bytes");
        // 2^40 entries with one index: auto picks Golomb-Rice, tiny, and it decodes back.
        SparseUpdate huge = update("w", SparseTensor.ofFloat32(new long[] {1L << 40},
                new long[] {(1L << 40) - 1}, new float[] {1}));
        try {
            byte[] data = WireCodec.encode(huge);
            check(WireCodec.tensorCodings(data).get("w") == IndexCoding.GOLOMB,
                    "2^40 entries: auto picks golomb");
            check(WireCodec.decode(data).equals(huge), "2^40 entries: last index round trips");
        } catch (DecodeException | RuntimeException e) {
            check(false, "2^40 entries with one index: " + e);
        }
        boolean threw = false;
        try {
            SparseTensor.ofFloat32(s10, new long[] {1, 2}, new float[] {1});
        } catch (IllegalArgumentException e) {
            threw = true;
        }
        check(threw, "SparseTensor refuses 1 value for 2 indices");
    }

    // ------------------------------------------------------------------------------------------
    // Algorithms
    // ------------------------------------------------------------------------------------------

    /** The descent gives the smallest b in [0, 62] of least exact cost, for any gap mix. */
    private static void riceParameterIsSmallestMinimiser() {
        Random rng = new Random(5);
        for (int trial = 0; trial < 300; trial++) {
            int n = 1 + rng.nextInt(200);
            long[] gaps = new long[n];
            int scale = rng.nextInt(40);
            for (int j = 0; j < n; j++) {
                // Mixtures of small and huge gaps: clustered selections where the estimate is off.
                gaps[j] = rng.nextInt(4) == 0 ? (rng.nextLong() >>> (24 + rng.nextInt(40)))
                        : (long) (rng.nextDouble() * (1L << scale));
            }
            long sum = 0;
            for (long gap : gaps) {
                sum += gap + 1;
            }
            long numel = sum + rng.nextInt(1000);
            int best = 0;
            for (int b = 1; b <= 62; b++) {
                if (IndexSections.riceCostBits(gaps, b) < IndexSections.riceCostBits(gaps, best)) {
                    best = b;
                }
            }
            int chosen = IndexSections.bestRiceParameter(gaps, numel);
            check(chosen == best, "Rice parameter " + chosen + " != brute force " + best
                    + " (trial " + trial + ")");
        }
    }

    /** Random updates of every coding and dtype decode back to themselves. */
    private static void randomRoundTrips() throws DecodeException {
        // Golomb-Rice (b = 0, one unary byte) and the bitmap both take 2 bytes: golomb wins.
        byte[] tie = WireCodec.encode(update("tie", SparseTensor.ofFloat32(new long[] {16},
                new long[] {0, 1}, new float[] {1, 2})));
        check(WireCodec.tensorCodings(tie).get("tie") == IndexCoding.GOLOMB,
                "a golomb/bitmap tie goes to golomb");
        Random rng = new Random(11);
        for (int trial = 0; trial < 200; trial++) {
            Map<String, SparseTensor> tensors = new LinkedHashMap<>();
            int count = 1 + rng.nextInt(4);
            for (int t = 0; t < count; t++) {
                int numel = rng.nextInt(3000);
                double density = new double[] {0.0, 0.001, 0.01, 0.1, 0.4, 0.9, 1.0}
                        [rng.nextInt(7)];
                long[] indices = sample(rng, numel, density);
                ValueDtype dtype = ValueDtype.values()[rng.nextInt(3)];
                float[] values = new float[indices.length];
                for (int i = 0; i < values.length; i++) {
                    values[i] = (float) rng.nextGaussian();
                }
                tensors.put("t" + t, SparseTensor.ofFloats(new long[] {numel}, indices, dtype,
                        values));
            }
            SparseUpdate u = new SparseUpdate(tensors, rng.nextLong());
            for (IndexCoding c : new IndexCoding[] {IndexCoding.AUTO, IndexCoding.GOLOMB,
                IndexCoding.BITMAP, IndexCoding.RAW}) {
                byte[] data = WireCodec.encode(u, c);
                check(WireCodec.decode(data).equals(u), "random update " + trial + " with " + c);
            }
        }
    }

    private static void halfFloatRoundTrips() {
        int bad16 = 0;
        int badBf16 = 0;
        for (int bits = 0; bits < 0x10000; bits++) {
            short s = (short) bits;
            if ((bits & 0x7C00) != 0x7C00) {
                float f = HalfFloats.float16ToFloat(s);
                if (HalfFloats.floatToFloat16(f) != s) {
                    bad16++;
                }
            }
            if ((bits & 0x7F80) != 0x7F80) {
                float f = HalfFloats.bfloat16ToFloat(s);
                if (HalfFloats.floatToBfloat16(f) != s) {
                    badBf16++;
                }
            }
        }
        check(bad16 == 0, bad16 + " float16 patterns do not survive to float and back");
        check(badBf16 == 0, badBf16 + " bfloat16 patterns do not survive to float and back");
        check(HalfFloats.float16ToFloat((short) 0x0001) == 0x1p-24f, "smallest float16 subnormal");
        check(HalfFloats.floatToFloat16(65520f) == (short) 0x7C00, "65520 rounds to float16 Inf");
        check(HalfFloats.floatToFloat16(65519.99f) == (short) 0x7BFF, "65519.99 stays finite");
    }

    // ------------------------------------------------------------------------------------------
    // Helpers
    // ------------------------------------------------------------------------------------------

    private static long[] sample(Random rng, int numel, double density) {
        long[] out = new long[numel];
        int k = 0;
        for (int i = 0; i < numel; i++) {
            if (density >= 1.0 || rng.nextDouble() < density) {
                out[k++] = i;
            }
        }
        return Arrays.copyOf(out, k);
    }

    private static SparseUpdate update(String name, SparseTensor t) {
        Map<String, SparseTensor> m = new LinkedHashMap<>();
        m.put(name, t);
        return new SparseUpdate(m, 1);
    }

    private static void check(boolean ok, String what) {
        checks++;
        if (!ok) {
            failures.add(what);
        }
    }

    private static void checkBytes(byte[] got, byte[] want, String what) {
        check(Arrays.equals(got, want), what + ": got " + hex(got) + ", want " + hex(want));
    }

    /** The reason decode rejects {@code data} with, or null when it accepts it. */
    private static DecodeException.Reason rejection(byte[] data) {
        try {
            WireCodec.decode(data);
            return null;
        } catch (DecodeException e) {
            return e.reason();
        } catch (RuntimeException e) {
            // The contract is DecodeException only: record this as a failure, not a crash.
            check(false, "decode threw " + e + " instead of DecodeException");
            return null;
        }
    }

    private static void expectReason(byte[] data, DecodeException.Reason want, String what) {
        DecodeException.Reason got = rejection(data);
        check(got == want, what + ": got " + got + ", expected " + want);
    }

    private static void expectRefusal(SparseUpdate u, IndexCoding c, String what) {
        try {
            WireCodec.encode(u, c);
            check(false, what + ": encode accepted it");
        } catch (EncodeException e) {
            check(e.getMessage() != null && !e.getMessage().isEmpty(), what + ": message");
        } catch (RuntimeException e) {
            check(false, what + ": encode threw " + e + " instead of EncodeException");
        }
    }

    private static byte[] withByte(byte[] data, int at, int value) {
        byte[] out = data.clone();
        out[at] = (byte) value;
        return out;
    }

    private static byte[] withCrc(byte[] body) {
        CRC32 crc = new CRC32();
        crc.update(body);
        ByteBuffer b = ByteBuffer.allocate(body.length + 4).order(ByteOrder.LITTLE_ENDIAN);
        return b.put(body).putInt((int) crc.getValue()).array();
    }

    private static byte[] concat(byte[] a, byte[] b) {
        byte[] out = Arrays.copyOf(a, a.length + b.length);
        System.arraycopy(b, 0, out, a.length, b.length);
        return out;
    }

    private static byte[] bytes(int... values) {
        byte[] out = new byte[values.length];
        for (int i = 0; i < values.length; i++) {
            out[i] = (byte) values[i];
        }
        return out;
    }

    private static byte[] u32s(long... values) {
        ByteBuffer b = ByteBuffer.allocate(4 * values.length).order(ByteOrder.LITTLE_ENDIAN);
        for (long v : values) {
            b.putInt((int) v);
        }
        return b.array();
    }

    private static byte[] u16s(int... values) {
        ByteBuffer b = ByteBuffer.allocate(2 * values.length).order(ByteOrder.LITTLE_ENDIAN);
        for (int v : values) {
            b.putShort((short) v);
        }
        return b.array();
    }

    private static byte[] f32s(float... values) {
        ByteBuffer b = ByteBuffer.allocate(4 * values.length).order(ByteOrder.LITTLE_ENDIAN);
        for (float v : values) {
            b.putFloat(v);
        }
        return b.array();
    }

    private static long[] longs(List<Object> list) {
        long[] out = new long[list.size()];
        for (int i = 0; i < out.length; i++) {
            out[i] = ((BigInteger) list.get(i)).longValue();
        }
        return out;
    }

    static byte[] unhex(String s) {
        byte[] out = new byte[s.length() / 2];
        for (int i = 0; i < out.length; i++) {
            out[i] = (byte) Integer.parseInt(s.substring(2 * i, 2 * i + 2), 16);
        }
        return out;
    }

    static String hex(byte[] data) {
        StringBuilder sb = new StringBuilder(2 * data.length);
        for (byte b : data) {
            sb.append(Character.forDigit((b >> 4) & 0xF, 16)).append(Character.forDigit(b & 0xF, 16));
        }
        return sb.toString();
    }
}
