package org.fedgc.wire;

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
 * The test driver of dgc_sets' host steps on the Java side (plain main, no JUnit), against
 * {@code tests/golden/dgc_sets.json} (written by {@code tests/golden/dgc_sets_golden.py}): the
 * rank request's decoder ({@link RankRequest}), the ranking and the sets
 * ({@link DisplacementRanking}), the grid ({@link GridValues}) and its grid-coded writer
 * ({@link WireCodec#encode(SparseUpdate, IndexCoding, boolean)}), {@code take_values} and
 * {@code encode_values}, the join of a ranked patch ({@link ContextPatch}); then malformed rank
 * requests, each refused for its reason. Prints one line per failed check and a summary; exits
 * 1 when anything failed. Usage: {@code java org.fedgc.wire.DgcSetsTest tests/golden/dgc_sets.json}.
 */
public final class DgcSetsTest {
    private static int checks;
    private static final List<String> failures = new ArrayList<>();

    private DgcSetsTest() {
    }

    @SuppressWarnings("unchecked")
    public static void main(String[] args) throws Exception {
        if (args.length != 1) {
            System.err.println("usage: DgcSetsTest DGC_SETS_GOLDEN_JSON");
            System.exit(2);
        }
        String json = new String(Files.readAllBytes(Paths.get(args[0])), StandardCharsets.UTF_8);
        Map<String, Object> doc = (Map<String, Object>) MiniJson.parse(json);
        for (Object c : (List<Object>) doc.get("rank_requests")) {
            rankRequest((Map<String, Object>) c);
        }
        for (Object c : (List<Object>) doc.get("rankings")) {
            ranking((Map<String, Object>) c);
        }
        for (Object c : (List<Object>) doc.get("exponents")) {
            exponent((Map<String, Object>) c);
        }
        for (Object c : (List<Object>) doc.get("on_grid")) {
            onGrid((Map<String, Object>) c);
        }
        for (Object c : (List<Object>) doc.get("grid_updates")) {
            gridUpdate((Map<String, Object>) c);
        }
        for (Object c : (List<Object>) doc.get("take_values")) {
            takeValues((Map<String, Object>) c);
        }
        for (Object c : (List<Object>) doc.get("sets_first")) {
            setsFirst((Map<String, Object>) c);
        }
        for (Object c : (List<Object>) doc.get("context_patches")) {
            contextPatch((Map<String, Object>) c);
        }
        malformedRankRequests();
        refusals();
        for (String f : failures) {
            System.out.println("FAIL " + f);
        }
        System.out.println((failures.isEmpty() ? "OK " : "FAILED ") + (checks - failures.size())
                + "/" + checks + " checks passed");
        System.exit(failures.isEmpty() ? 0 : 1);
    }

    @SuppressWarnings("unchecked")
    private static void rankRequest(Map<String, Object> c) throws DecodeException {
        String name = "rank request " + c.get("case");
        Map<String, Long> numels = longMap((Map<String, Object>) c.get("numels"));
        RankRequest r = RankRequest.decode(WireCodecTest.unhex((String) c.get("hex")), numels);
        check(r.sequence() == ((BigInteger) c.get("sequence")).longValue(), name + ": sequence");
        Map<String, Long> counts = longMap((Map<String, Object>) c.get("counts"));
        check(new ArrayList<>(r.counts().entrySet()).equals(new ArrayList<>(counts.entrySet())),
                name + ": counts " + r.counts() + ", recorded " + counts);
        check(r.initialOnGrid() == (Boolean) c.get("initial_on_grid"), name + ": grid flag");
        check(r.explore().equals(longMap((Map<String, Object>) c.get("explore"))),
                name + ": explore " + r.explore());
        check(RankRequest.isRankRequest(WireCodecTest.unhex((String) c.get("hex"))),
                name + ": told apart by its magic");
    }

    @SuppressWarnings("unchecked")
    private static void ranking(Map<String, Object> c) {
        String name = "ranking " + c.get("case");
        float[] model = floats((List<Object>) c.get("model_bits"));
        float[] initial = floats((List<Object>) c.get("initial_bits"));
        int[] order = DisplacementRanking.ranked(model, initial);
        long[] want = longs((List<Object>) c.get("order"));
        check(Arrays.equals(Arrays.stream(order).asLongStream().toArray(), want),
                name + ": the full order");
        List<Object> counts = (List<Object>) c.get("counts");
        List<Object> sets = (List<Object>) c.get("sets");
        for (int i = 0; i < counts.size(); i++) {
            long k = ((BigInteger) counts.get(i)).longValue();
            long[] set = DisplacementRanking.top(model, initial, k);
            check(Arrays.equals(set, longs((List<Object>) sets.get(i))), name + ": the set of "
                    + k + " " + Arrays.toString(set));
        }
    }

    private static void exponent(Map<String, Object> c) {
        float mean = Float.intBitsToFloat(((BigInteger) c.get("mean_bits")).intValue());
        double levels = (Double) c.get("levels");
        int want = ((BigInteger) c.get("exponent")).intValue();
        int got = GridValues.exponent(mean, levels);
        check(got == want, "exponent of mean " + mean + " levels " + levels + ": " + got
                + ", recorded " + want);
    }

    @SuppressWarnings("unchecked")
    private static void onGrid(Map<String, Object> c) {
        float[] values = floats((List<Object>) c.get("value_bits"));
        float[] got = GridValues.onGrid(values, (Double) c.get("levels"));
        check(Arrays.equals(bits(got), longs((List<Object>) c.get("grid_bits"))),
                "on_grid " + c.get("case") + ": " + Arrays.toString(got));
    }

    @SuppressWarnings("unchecked")
    private static void gridUpdate(Map<String, Object> c) {
        String name = "grid update " + c.get("case");
        Map<String, SparseTensor> tensors = new LinkedHashMap<>();
        for (Object o : (List<Object>) c.get("tensors")) {
            Map<String, Object> t = (Map<String, Object>) o;
            long[] raw = longs((List<Object>) t.get("value_bits"));
            int[] rawBits = new int[raw.length];
            for (int i = 0; i < raw.length; i++) {
                rawBits[i] = (int) raw[i];
            }
            tensors.put((String) t.get("name"), SparseTensor.ofRawBits(
                    longs((List<Object>) t.get("shape")), longs((List<Object>) t.get("indices")),
                    ValueDtype.fromName((String) t.get("dtype")), rawBits));
        }
        SparseUpdate update = new SparseUpdate(tensors,
                ((BigInteger) c.get("sequence")).longValue());
        byte[] want = WireCodecTest.unhex((String) c.get("hex"));
        byte[] got = WireCodec.encode(update, IndexCoding.AUTO, true);
        check(Arrays.equals(got, want), name + ": encodes to " + WireCodecTest.hex(got)
                + ", recorded " + WireCodecTest.hex(want));
        try {
            check(WireCodec.decode(got).equals(update), name + ": decodes to the same bits");
        } catch (DecodeException e) {
            check(false, name + ": its own bytes are refused: " + e.getMessage());
        }
    }

    @SuppressWarnings("unchecked")
    private static void takeValues(Map<String, Object> c) {
        String name = "take_values " + c.get("case");
        double levels = (Double) c.get("levels");
        Map<String, Object> residualBits = (Map<String, Object>) c.get("residual_bits");
        Map<String, Object> sets = (Map<String, Object>) c.get("sets");
        Map<String, float[]> sent = new LinkedHashMap<>();
        for (Map.Entry<String, Object> e : sets.entrySet()) {
            float[] residual = floats((List<Object>) residualBits.get(e.getKey()));
            float[] values = GridValues.takeValues(residual, longs((List<Object>) e.getValue()),
                    levels);
            sent.put(e.getKey(), values);
            check(Arrays.equals(bits(values), longs((List<Object>) ((Map<String, Object>)
                    c.get("sent_bits")).get(e.getKey()))), name + ": sent of " + e.getKey());
            check(Arrays.equals(bits(residual), longs((List<Object>) ((Map<String, Object>)
                    c.get("left_bits")).get(e.getKey()))), name + ": left of " + e.getKey());
        }
        byte[] got = GridValues.encodeValues(sent, ((BigInteger) c.get("sequence")).longValue());
        check(WireCodecTest.hex(got).equals(c.get("hex")), name + ": encode_values bytes "
                + WireCodecTest.hex(got));
    }

    @SuppressWarnings("unchecked")
    private static void setsFirst(Map<String, Object> c) {
        String name = "sets first " + c.get("case");
        Map<String, float[]> grads = floatMap((Map<String, Object>) c.get("gradient_bits"));
        Map<String, float[]> residual = floatMap((Map<String, Object>) c.get("residual_bits"));
        Map<String, long[]> sets = new LinkedHashMap<>();
        for (Map.Entry<String, Object> e : ((Map<String, Object>) c.get("sets")).entrySet()) {
            sets.put(e.getKey(), longs((List<Object>) e.getValue()));
        }
        long sequence = ((BigInteger) c.get("sequence")).longValue();
        SetsFirst split = SetsFirst.split(grads, residual, sets, (Boolean) c.get("started"),
                (Double) c.get("levels"), sequence);
        Map<String, float[]> compressed = floatMap((Map<String, Object>) c.get("compressed_bits"));
        check(split.gradients.keySet().equals(compressed.keySet()), name + ": tensors handed on");
        for (Map.Entry<String, float[]> e : compressed.entrySet()) {
            check(Arrays.equals(bits(split.gradients.get(e.getKey())), bits(e.getValue())),
                    name + ": the gradient the encoder gets, " + e.getKey());
        }
        Map<String, float[]> sent = floatMap((Map<String, Object>) c.get("sent_bits"));
        check(split.sent.keySet().equals(sent.keySet()), name + ": tensors sent");
        for (Map.Entry<String, float[]> e : sent.entrySet()) {
            check(Arrays.equals(bits(split.sent.get(e.getKey())), bits(e.getValue())),
                    name + ": sent at the set of " + e.getKey());
        }
        Map<String, Object> restored = (Map<String, Object>) c.get("restored");
        check((split.remainder == null) == restored.isEmpty(), name + ": a remainder or none");
        if (split.remainder != null) {
            check(split.remainder.tensors().keySet().equals(restored.keySet()),
                    name + ": remainder tensors");
            for (Map.Entry<String, SparseTensor> e : split.remainder.tensors().entrySet()) {
                Map<String, Object> want = (Map<String, Object>) restored.get(e.getKey());
                SparseTensor t = e.getValue();
                check(Arrays.equals(t.indices(), longs((List<Object>) want.get("indices")))
                        && Arrays.equals(bits(t.valuesAsFloat()),
                        longs((List<Object>) want.get("value_bits"))), name + ": remainder of "
                        + e.getKey());
                float[] v = residual.get(e.getKey());  // the encoder's restore
                for (int i = 0; i < t.nnz(); i++) {
                    v[(int) t.index(i)] += t.value(i);
                }
            }
        }
        Map<String, float[]> after = floatMap((Map<String, Object>) c.get("residual_after_bits"));
        for (Map.Entry<String, float[]> e : after.entrySet()) {
            check(Arrays.equals(bits(residual.get(e.getKey())), bits(e.getValue())),
                    name + ": the residual after the round, " + e.getKey());
        }
        check(WireCodecTest.hex(GridValues.encodeValues(split.sent, sequence)).equals(c.get("hex")),
                name + ": the bytes the sets send");
    }

    @SuppressWarnings("unchecked")
    private static void contextPatch(Map<String, Object> c) throws DecodeException {
        String name = "context patch " + c.get("case");
        Map<String, float[]> held = floatMap((Map<String, Object>) c.get("held_bits"));
        Map<String, float[]> version0 = floatMap((Map<String, Object>) c.get("initial_bits"));
        SparseUpdate patch = WireCodec.decode(WireCodecTest.unhex((String) c.get("hex")));
        Map<String, float[]> before = new LinkedHashMap<>();
        for (Map.Entry<String, float[]> e : held.entrySet()) {
            before.put(e.getKey(), e.getValue().clone());
        }
        try {
            Map<String, float[]> model = ContextPatch.apply(held, patch, version0);
            check(!c.containsKey("error"), name + ": applied, Python refused: " + c.get("error"));
            Map<String, float[]> want = floatMap((Map<String, Object>) c.get("model_bits"));
            check(model.keySet().equals(want.keySet()), name + ": tensors " + model.keySet());
            for (Map.Entry<String, float[]> e : want.entrySet()) {
                check(Arrays.equals(bits(model.get(e.getKey())), bits(e.getValue())),
                        name + ": tensor " + e.getKey());
            }
        } catch (ContextPatch.PatchException e) {
            check(e.getMessage().replace("[", "").replace("]", "").replace("'", "")
                    .replace("(", "").replace(")", "").replace(",", "")
                    .equals(((String) c.get("error")).replace("[", "").replace("]", "")
                            .replace("'", "").replace("(", "").replace(")", "")
                            .replace(",", "")),
                    name + ": refused with '" + e.getMessage() + "', Python: " + c.get("error"));
        }
        for (Map.Entry<String, float[]> e : before.entrySet()) {
            check(Arrays.equals(e.getValue(), held.get(e.getKey())), name + ": held model "
                    + "unchanged");
        }
    }

    /** A rank request built field by field, with a valid checksum unless told otherwise. */
    private static byte[] request(int version, int flags, Object[][] sets, byte[] extra,
                                  boolean goodCrc) {
        ByteBuffer b = ByteBuffer.allocate(4096).order(ByteOrder.LITTLE_ENDIAN);
        b.put(RankRequest.MAGIC).put((byte) version).putLong(3).putInt(sets.length)
                .put((byte) flags);
        for (Object[] s : sets) {
            byte[] name = ((String) s[0]).getBytes(StandardCharsets.UTF_8);
            b.putShort((short) name.length).put(name).putLong((Long) s[1]).putLong((Long) s[2]);
            if (s.length > 3) {
                b.putLong((Long) s[3]);
            }
        }
        b.put(extra);
        byte[] body = Arrays.copyOf(b.array(), b.position());
        CRC32 crc = new CRC32();
        crc.update(body);
        return ByteBuffer.allocate(body.length + 4).order(ByteOrder.LITTLE_ENDIAN).put(body)
                .putInt((int) crc.getValue() ^ (goodCrc ? 0 : 1)).array();
    }

    private static void malformedRankRequests() throws DecodeException {
        Map<String, Long> numels = new LinkedHashMap<>();
        numels.put("w", 100L);
        numels.put("b", 10L);
        byte[] ok = request(1, 0, new Object[][]{{"w", 100L, 5L}, {"b", 10L, 10L}}, new byte[0],
                true);
        check(RankRequest.decode(ok, numels).counts().get("w") == 5L, "a crafted request reads");
        for (int n = 0; n < ok.length; n++) {
            expectRank(Arrays.copyOf(ok, n), numels, null, "a prefix of " + n + " bytes");
        }
        for (int i = 0; i < ok.length; i++) {
            for (int bit = 0; bit < 8; bit++) {
                byte[] flipped = ok.clone();
                flipped[i] ^= (byte) (1 << bit);
                expectRank(flipped, numels, null, "bit " + bit + " of byte " + i + " flipped");
            }
        }
        byte[] magic = ok.clone();
        magic[3] = 'M';
        expectRank(magic, numels, DecodeException.Reason.BAD_MAGIC, "an FGCM mask's magic");
        expectRank(request(2, 0, new Object[][]{{"w", 100L, 5L}}, new byte[0], true), numels,
                DecodeException.Reason.UNSUPPORTED_VERSION, "version 2");
        expectRank(request(1, 0, new Object[][]{{"w", 100L, 5L}}, new byte[0], false), numels,
                DecodeException.Reason.BAD_CHECKSUM, "a bad checksum");
        expectRank(request(1, 4, new Object[][]{{"w", 100L, 5L}}, new byte[0], true), numels,
                DecodeException.Reason.UNSUPPORTED_FLAGS, "flag bit 2");
        expectRank(request(1, 0, new Object[][]{{"x", 100L, 5L}}, new byte[0], true), numels,
                DecodeException.Reason.BAD_RANKED_SET, "a tensor the model lacks");
        expectRank(request(1, 0, new Object[][]{{"w", 101L, 5L}}, new byte[0], true), numels,
                DecodeException.Reason.BAD_RANKED_SET, "a tensor of another size");
        expectRank(request(1, 0, new Object[][]{{"w", 100L, 0L}}, new byte[0], true), numels,
                DecodeException.Reason.BAD_RANKED_SET, "an empty set");
        expectRank(request(1, 0, new Object[][]{{"w", 100L, 101L}}, new byte[0], true), numels,
                DecodeException.Reason.BAD_RANKED_SET, "a set above its tensor");
        expectRank(request(1, 0, new Object[][]{{"w", 100L, -1L}}, new byte[0], true), numels,
                DecodeException.Reason.BAD_RANKED_SET, "a set of 2^64 - 1");
        expectRank(request(1, 2, new Object[][]{{"w", 100L, 5L, 6L}}, new byte[0], true), numels,
                DecodeException.Reason.BAD_RANKED_SET, "more drawn than the set holds");
        expectRank(request(1, 0, new Object[][]{{"w", 100L, 5L}, {"w", 100L, 5L}}, new byte[0],
                true), numels, DecodeException.Reason.DUPLICATE_NAME, "a tensor twice");
        expectRank(request(1, 0, new Object[][]{{"w", 100L, 5L}}, new byte[]{0}, true), numels,
                DecodeException.Reason.TRAILING, "a byte after the last set");
        expectRank(request(1, 2, new Object[][]{{"w", 100L, 5L}}, new byte[0], true), numels,
                DecodeException.Reason.TRUNCATED, "a draw flag without the draw");
        byte[] badName = request(1, 0, new Object[][]{{"w", 100L, 5L}}, new byte[0], true);
        badName[20] = (byte) 0xC3;  // the name "w" as a lone lead byte
        CRC32 crc = new CRC32();
        crc.update(badName, 0, badName.length - 4);
        ByteBuffer.wrap(badName).order(ByteOrder.LITTLE_ENDIAN).putInt(badName.length - 4,
                (int) crc.getValue());
        expectRank(badName, numels, DecodeException.Reason.BAD_UTF8, "a name not UTF-8");
        expectRank(null, numels, DecodeException.Reason.TRUNCATED, "null");
    }

    /** The API's refusals of what a phone could be handed wrongly. */
    private static void refusals() throws DecodeException {
        Map<String, Long> numels = new LinkedHashMap<>();
        numels.put("w", 4L);
        float[] w = {0f, 1f, 0f, 0f};
        float[] zero = new float[4];
        RankRequest drawn = RankRequest.decode(request(1, 2, new Object[][]{{"w", 4L, 2L, 1L}},
                new byte[0], true), numels);
        refused(() -> DisplacementRanking.sets(drawn, Map.of("w", w), Map.of("w", zero)),
                UnsupportedOperationException.class, "a set drawn at random",
                "draws 1 of its 2 entries");
        RankRequest plain = RankRequest.decode(request(1, 0, new Object[][]{{"w", 4L, 2L}},
                new byte[0], true), numels);
        check(Arrays.equals(DisplacementRanking.sets(plain, Map.of("w", w), Map.of("w", zero))
                .get("w"), new long[]{0, 1}), "a plain request's set: the moved entry and "
                + "the lowest tie");
        RankRequest noDraw = RankRequest.decode(request(1, 2, new Object[][]{{"w", 4L, 1L, 0L}},
                new byte[0], true), numels);
        check(Arrays.equals(DisplacementRanking.sets(noDraw, Map.of("w", w), Map.of("w", zero))
                .get("w"), new long[]{1}), "a request with the draw flag and nothing drawn");
        refused(() -> DisplacementRanking.sets(plain, Map.of("w", w), Map.of()),
                IllegalArgumentException.class, "version 0 without the tensor",
                "which the version 0 lacks");
        refused(() -> DisplacementRanking.ranked(w, new float[3]),
                IllegalArgumentException.class, "version 0 of another size", "of 3");
        refused(() -> DisplacementRanking.top(w, zero, 5), IllegalArgumentException.class,
                "a set above its tensor", "expected 1 to 4");
        refused(() -> GridValues.onGrid(w, 0), IllegalArgumentException.class, "levels 0",
                "got 0.0");
        refused(() -> GridValues.onGrid(w, Double.NaN), IllegalArgumentException.class,
                "levels NaN", "got NaN");
        float[] residual = {1f, 2f, 3f};
        refused(() -> GridValues.takeValues(residual, new long[]{0, 3}, 0.5),
                IllegalArgumentException.class, "a set index beyond the residual",
                "index 3 at position 1");
        check(Arrays.equals(residual, new float[]{1f, 2f, 3f}), "a refused take_values changes "
                + "nothing");
        refused(() -> SetsFirst.split(Map.of("w", w), Map.of("w", zero), Map.of("x",
                new long[]{0}), true, 0.5, 1), IllegalArgumentException.class,
                "a set of a tensor the gradient lacks", "which the pseudo-gradient lacks");
        refused(() -> SetsFirst.split(Map.of("w", w), Map.of("w", zero), Map.of("w",
                new long[]{0, 4}), true, 0.5, 1), IllegalArgumentException.class,
                "a set index beyond the tensor", "index 4, outside [0, 4)");
        check(Arrays.equals(zero, new float[4]), "a refused split changes nothing");
    }

    private interface Action {
        void run() throws Exception;
    }

    private static void refused(Action action, Class<? extends Exception> type, String what,
                                String words) {
        try {
            action.run();
            check(false, what + ": accepted");
        } catch (Exception e) {
            check(type.isInstance(e) && e.getMessage().contains(words), what + ": " + e);
        }
    }

    private static void expectRank(byte[] data, Map<String, Long> numels,
                                   DecodeException.Reason want, String what) {
        try {
            RankRequest.decode(data, numels);
            check(false, what + ": accepted");
        } catch (DecodeException e) {
            check(want == null || e.reason() == want, what + ": " + e.reason() + ", expected "
                    + want + " (" + e.getMessage() + ")");
        } catch (RuntimeException e) {
            check(false, what + ": threw " + e + " instead of DecodeException");
        }
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

    private static float[] floats(List<Object> bits) {
        float[] out = new float[bits.size()];
        for (int i = 0; i < out.length; i++) {
            out[i] = Float.intBitsToFloat(((BigInteger) bits.get(i)).intValue());
        }
        return out;
    }

    private static long[] bits(float[] values) {
        long[] out = new long[values.length];
        for (int i = 0; i < out.length; i++) {
            out[i] = Float.floatToRawIntBits(values[i]) & 0xFFFFFFFFL;
        }
        return out;
    }

    private static Map<String, Long> longMap(Map<String, Object> m) {
        Map<String, Long> out = new LinkedHashMap<>();
        for (Map.Entry<String, Object> e : m.entrySet()) {
            out.put(e.getKey(), ((BigInteger) e.getValue()).longValue());
        }
        return out;
    }

    @SuppressWarnings("unchecked")
    private static Map<String, float[]> floatMap(Map<String, Object> m) {
        Map<String, float[]> out = new LinkedHashMap<>();
        for (Map.Entry<String, Object> e : m.entrySet()) {
            out.put(e.getKey(), floats((List<Object>) e.getValue()));
        }
        return out;
    }
}
