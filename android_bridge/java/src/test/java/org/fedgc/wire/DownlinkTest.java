package org.fedgc.wire;

import java.math.BigInteger;
import java.nio.charset.StandardCharsets;
import java.nio.file.Files;
import java.nio.file.Paths;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * The test driver of the two downlink messages the Java codec reads besides the update message
 * (plain main, no JUnit), against {@code tests/golden/downlink.json} (written by
 * {@code tests/golden/downlink_golden.py}): a round's shared index sets ({@link SharedMask},
 * {@code FGCM}) decoded and re-encoded byte for byte, the compact update ({@link CompactCodec},
 * {@code FGCK}) decoded to Python's indices and value bits on a model's or a patch's layout
 * (whose digest it checks); each malformed message refused for Python's reason; every prefix
 * and every single-bit flip of each golden message refused with a {@link DecodeException}.
 * Prints one line per failed check and a summary; exits 1 when anything failed. Usage:
 * {@code java org.fedgc.wire.DownlinkTest tests/golden/downlink.json}.
 */
public final class DownlinkTest {
    private static int checks;
    private static final List<String> failures = new ArrayList<>();

    private DownlinkTest() {
    }

    @SuppressWarnings("unchecked")
    public static void main(String[] args) throws Exception {
        if (args.length != 1) {
            System.err.println("usage: DownlinkTest DOWNLINK_GOLDEN_JSON");
            System.exit(2);
        }
        String json = new String(Files.readAllBytes(Paths.get(args[0])), StandardCharsets.UTF_8);
        Map<String, Object> doc = (Map<String, Object>) MiniJson.parse(json);
        for (Object c : (List<Object>) doc.get("masks")) {
            mask((Map<String, Object>) c);
        }
        for (Object c : (List<Object>) doc.get("mask_refusals")) {
            maskRefusal((Map<String, Object>) c);
        }
        for (Object c : (List<Object>) doc.get("compact")) {
            compact((Map<String, Object>) c);
        }
        for (Object c : (List<Object>) doc.get("compact_refusals")) {
            compactRefusal((Map<String, Object>) c);
        }
        layoutOrder();
        for (String f : failures) {
            System.out.println("FAIL " + f);
        }
        System.out.println((failures.isEmpty() ? "OK " : "FAILED ") + (checks - failures.size())
                + "/" + checks + " checks passed");
        System.exit(failures.isEmpty() ? 0 : 1);
    }

    private interface Decoder {
        void decode(byte[] data) throws DecodeException;
    }

    @SuppressWarnings("unchecked")
    private static void mask(Map<String, Object> c) {
        String name = "mask " + c.get("case");
        byte[] data = WireCodecTest.unhex((String) c.get("hex"));
        Map<String, Long> numels = longMap((Map<String, Object>) c.get("numels"));
        SharedMask m;
        try {
            m = SharedMask.decode(data, numels);
        } catch (DecodeException e) {
            check(false, name + ": refused " + e.reason() + " " + e.getMessage());
            return;
        }
        check(m.sequence() == ((BigInteger) c.get("sequence")).longValue(), name + ": sequence");
        Map<String, Object> sets = (Map<String, Object>) c.get("sets");
        check(new ArrayList<>(m.sets().keySet()).equals(new ArrayList<>(sets.keySet())),
                name + ": tensors " + m.sets().keySet() + ", recorded " + sets.keySet());
        for (Map.Entry<String, Object> e : sets.entrySet()) {
            long[] want = longs((List<Object>) e.getValue());
            check(Arrays.equals(m.sets().get(e.getKey()), want), name + ": the set of '"
                    + e.getKey() + "'");
        }
        check(Arrays.equals(SharedMask.encode(m.sets(), numels, m.sequence()), data),
                name + ": re-encoded byte for byte");
        check(SharedMask.isSharedMask(data) && !RankRequest.isRankRequest(data)
                && !CompactCodec.isCompact(data), name + ": told apart by its magic");
        damaged(name, data, bytes -> SharedMask.decode(bytes, numels));
    }

    @SuppressWarnings("unchecked")
    private static void maskRefusal(Map<String, Object> c) {
        Map<String, Long> numels = longMap((Map<String, Object>) c.get("numels"));
        expect("mask refusal " + c.get("case"), WireCodecTest.unhex((String) c.get("hex")),
                bytes -> SharedMask.decode(bytes, numels), (String) c.get("reason"),
                (String) c.get("message"));
    }

    @SuppressWarnings("unchecked")
    private static CompactCodec.Layout layoutOf(Map<String, Object> c) {
        Map<String, long[]> shapes = new LinkedHashMap<>();
        for (Map.Entry<String, Object> e : ((Map<String, Object>) c.get("shapes")).entrySet()) {
            shapes.put(e.getKey(), longs((List<Object>) e.getValue()));
        }
        List<Object> context = (List<Object>) c.get("context");
        if (context == null || context.isEmpty()) {
            return CompactCodec.Layout.of(shapes);
        }
        List<String> names = new ArrayList<>();
        for (Object o : context) {
            names.add((String) o);
        }
        return CompactCodec.Layout.patch(shapes, names);
    }

    @SuppressWarnings("unchecked")
    private static void compact(Map<String, Object> c) {
        String name = "compact " + c.get("case");
        byte[] data = WireCodecTest.unhex((String) c.get("hex"));
        CompactCodec.Layout layout = layoutOf(c);
        long maxNumel = ((BigInteger) c.get("max_numel")).longValue();
        check(layout.digest() == ((BigInteger) c.get("digest")).longValue(), name
                + ": layout digest " + layout.digest() + ", recorded " + c.get("digest"));
        SparseUpdate u;
        try {
            u = CompactCodec.decode(data, layout, maxNumel);
        } catch (DecodeException e) {
            check(false, name + ": refused " + e.reason() + " " + e.getMessage());
            return;
        }
        check(u.sequence() == ((BigInteger) c.get("sequence")).longValue(), name + ": sequence");
        List<Object> tensors = (List<Object>) c.get("tensors");
        check(u.tensors().size() == tensors.size(), name + ": " + u.tensors().size()
                + " tensors, recorded " + tensors.size());
        List<String> order = new ArrayList<>(u.tensors().keySet());
        for (int i = 0; i < tensors.size(); i++) {
            Map<String, Object> t = (Map<String, Object>) tensors.get(i);
            String tn = (String) t.get("name");
            check(i < order.size() && order.get(i).equals(tn), name + ": tensor " + i + " is '"
                    + tn + "'");
            SparseTensor got = u.tensors().get(tn);
            if (got == null) {
                continue;
            }
            check(Arrays.equals(got.shape(), longs((List<Object>) t.get("shape"))), name + ": '"
                    + tn + "' shape " + Arrays.toString(got.shape()));
            check(got.dtype() == ValueDtype.fromName((String) t.get("dtype")), name + ": '" + tn
                    + "' dtype " + got.dtype());
            check(Arrays.equals(got.indices(), longs((List<Object>) t.get("indices"))), name
                    + ": '" + tn + "' indices");
            long[] want = longs((List<Object>) t.get("value_bits"));
            long[] bits = new long[got.nnz()];
            for (int j = 0; j < bits.length; j++) {
                bits[j] = got.rawBits(j) & (got.dtype() == ValueDtype.FLOAT32 ? 0xFFFFFFFFL
                        : 0xFFFFL);
            }
            check(Arrays.equals(bits, want), name + ": '" + tn + "' value bits");
        }
        check(CompactCodec.isCompact(data) && !SharedMask.isSharedMask(data), name
                + ": told apart by its magic");
        damaged(name, data, bytes -> CompactCodec.decode(bytes, layout, maxNumel));
    }

    private static void compactRefusal(Map<String, Object> c) {
        CompactCodec.Layout layout = layoutOf(c);
        long maxNumel = ((BigInteger) c.get("max_numel")).longValue();
        expect("compact refusal " + c.get("case"), WireCodecTest.unhex((String) c.get("hex")),
                bytes -> CompactCodec.decode(bytes, layout, maxNumel), (String) c.get("reason"),
                (String) c.get("message"));
    }

    /** Python's order of names (code points), where UTF-16 units would order them otherwise. */
    private static void layoutOrder() {
        Map<String, long[]> shapes = new LinkedHashMap<>();
        shapes.put("z\uD83D\uDE00", new long[]{1});  // U+1F600
        shapes.put("z\uFFFF", new long[]{1});
        shapes.put("a", new long[]{2, 3});
        CompactCodec.Layout layout = CompactCodec.Layout.of(shapes);
        check(layout.name(0).equals("a") && layout.name(1).equals("z\uFFFF")
                && layout.name(2).equals("z\uD83D\uDE00"), "layout order by code point: " + layout);
        try {
            CompactCodec.Layout.patch(shapes, List.of("b"));
            check(false, "a patch layout on a context tensor the model lacks: accepted");
        } catch (IllegalArgumentException e) {
            check(e.getMessage().contains("'b'"), "a patch layout on a context tensor the model "
                    + "lacks: " + e);
        }
        try {
            SharedMask.encode(Map.of("w", new long[]{3, 3}), Map.of("w", 10L), 1);
            check(false, "a mask of a repeated index: encoded");
        } catch (IllegalArgumentException e) {
            check(e.getMessage().contains("position 1"), "a mask of a repeated index: " + e);
        }
        try {
            SharedMask.encode(Map.of("w\uD800", new long[]{3}), Map.of("w\uD800", 10L), 1);
            check(false, "a mask of a name with an unpaired surrogate: encoded");
        } catch (IllegalArgumentException e) {
            check(e.getMessage().contains("unpaired surrogate"), "a mask of a name with an "
                    + "unpaired surrogate: " + e);
        }
        expect("null mask", null, bytes -> SharedMask.decode(bytes, Map.of()), "TRUNCATED", "");
        expect("null compact", null, bytes -> CompactCodec.decode(bytes, layout, 10),
                "TRUNCATED", "");
    }

    /** Every prefix and every single-bit flip of a golden message: a DecodeException each. */
    private static void damaged(String name, byte[] data, Decoder decoder) {
        int bad = 0;
        String first = null;
        for (int n = 0; n < data.length; n++) {
            String why = refusal(decoder, Arrays.copyOf(data, n));
            if (why != null) {
                bad++;
                first = first == null ? "prefix " + n + ": " + why : first;
            }
        }
        for (int bit = 0; bit < 8 * data.length; bit++) {
            byte[] flipped = data.clone();
            flipped[bit / 8] ^= (byte) (1 << (bit % 8));
            String why = refusal(decoder, flipped);
            if (why != null) {
                bad++;
                first = first == null ? "bit " + bit + ": " + why : first;
            }
        }
        checks += 9 * data.length - 1;  // one check each, less the one below
        check(bad == 0, name + ": " + bad + " damaged copies not refused with a DecodeException,"
                + " first " + first);
    }

    /** Null when {@code decoder} refuses {@code data} with a DecodeException; else why not. */
    private static String refusal(Decoder decoder, byte[] data) {
        try {
            decoder.decode(data);
            return "accepted";
        } catch (DecodeException e) {
            return null;
        } catch (RuntimeException e) {
            return "threw " + e;
        }
    }

    private static void expect(String what, byte[] data, Decoder decoder, String reason,
                               String message) {
        try {
            decoder.decode(data);
            check(false, what + ": accepted (Python: " + message + ")");
        } catch (DecodeException e) {
            check(e.reason().name().equals(reason), what + ": " + e.reason() + ", expected "
                    + reason + " (Java: " + e.getMessage() + "; Python: " + message + ")");
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

    private static Map<String, Long> longMap(Map<String, Object> m) {
        Map<String, Long> out = new LinkedHashMap<>();
        for (Map.Entry<String, Object> e : m.entrySet()) {
            out.put(e.getKey(), ((BigInteger) e.getValue()).longValue());
        }
        return out;
    }
}
