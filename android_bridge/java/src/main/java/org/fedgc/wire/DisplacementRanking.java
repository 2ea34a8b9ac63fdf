package org.fedgc.wire;

import java.util.Arrays;
import java.util.LinkedHashMap;
import java.util.Map;

/**
 * A tensor's entries ranked by displacement from version 0, {@code |model - version0|} largest
 * first, ties to the lower position (a stable sort): the order both ends compute alike under
 * {@code dgc_sets} ({@code dgc.ranking}), for the round's shared sets ({@link #sets}, as
 * {@code dgc.signs.planner.displacement_masks}) and the segments of a ranked patch
 * ({@link ContextPatch}).
 *
 * <p>As {@code dgc.ranking}, each entry gets one distinct long key, the complemented float32
 * bits of its displacement above its position, whose ascending order is the ranking: an
 * ordinary sort of the keys gives exactly the stable sort's order. The displacement is the
 * float32 difference's absolute value, as torch computes it. Stateless; plain Java.
 */
public final class DisplacementRanking {
    /** Above every non-negative float32 bit pattern: complementing turns largest-first into
     * ascending. */
    private static final long BITS_TOP = 0x7FFFFFFFL;
    private static final long POSITION_MASK = 0xFFFFFFFFL;

    private DisplacementRanking() {
    }

    /** The sorted keys of {@code |model - origin|}. */
    private static long[] sortedKeys(float[] model, float[] origin) {
        if (model.length != origin.length) {
            throw new IllegalArgumentException("a tensor of " + model.length + " entries ranked "
                    + "against version 0 of " + origin.length);
        }
        long[] keys = new long[model.length];
        for (int i = 0; i < keys.length; i++) {
            long bits = Float.floatToRawIntBits(Math.abs(model[i] - origin[i])) & 0xFFFFFFFFL;
            keys[i] = ((BITS_TOP - bits) << 32) | i;
        }
        Arrays.sort(keys);
        return keys;
    }

    /**
     * The flat positions of {@code model}'s entries by displacement from {@code origin}, most
     * displaced first, ties by position ({@code dgc.ranking.ranked}).
     *
     * @throws IllegalArgumentException when the two sizes differ
     */
    public static int[] ranked(float[] model, float[] origin) {
        long[] keys = sortedKeys(model, origin);
        int[] order = new int[keys.length];
        for (int i = 0; i < keys.length; i++) {
            order[i] = (int) (keys[i] & POSITION_MASK);
        }
        return order;
    }

    /**
     * The {@code k} most displaced entries of one tensor, sorted by position (its shared set).
     *
     * @throws IllegalArgumentException when the sizes differ or {@code k} is not in 1..numel
     */
    public static long[] top(float[] model, float[] origin, long k) {
        if (k < 1 || k > model.length) {
            throw new IllegalArgumentException("shared set of " + k + " entries of a tensor of "
                    + model.length + "; expected 1 to " + model.length);
        }
        long[] keys = sortedKeys(model, origin);
        long[] set = new long[(int) k];
        for (int i = 0; i < set.length; i++) {
            set[i] = keys[i] & POSITION_MASK;
        }
        Arrays.sort(set);
        return set;
    }

    /**
     * The round's shared sets a rank request stands for: per tensor, the entries where
     * {@code |model - version0|} is largest ({@link #top}), in the request's order.
     * {@code model} is the round's model, {@code version0} in the form the task's
     * {@code initial_sha256} names (as built, or on the int8 grid).
     *
     * @throws IllegalArgumentException naming a tensor the model or version 0 lacks or holds
     *     at another size
     * @throws UnsupportedOperationException for a set whose rest is drawn at random
     *     ({@code dgc.shared_explore}: NumPy's PCG64 and {@code Generator.choice}, not built
     *     here; off by default outside secure aggregation, which phones do not run)
     */
    public static Map<String, long[]> sets(RankRequest request, Map<String, float[]> model,
                                           Map<String, float[]> version0) {
        Map<String, long[]> out = new LinkedHashMap<>();
        for (Map.Entry<String, Long> e : request.counts().entrySet()) {
            String name = e.getKey();
            float[] now = model.get(name);
            float[] then = version0.get(name);
            if (now == null || then == null) {
                throw new IllegalArgumentException("rank request names tensor '" + name
                        + "', which the " + (now == null ? "model" : "version 0") + " lacks");
            }
            long k = e.getValue();
            if (request.explore().isEmpty()) {
                out.put(name, top(now, then, k));
                continue;
            }
            // As displacement_masks with a draw: only entries that moved, at most k - drawn.
            long moved = 0;
            for (int i = 0; i < now.length; i++) {
                moved += now[i] != then[i] ? 1 : 0;
            }
            long ranked = Math.min(k - request.explore().getOrDefault(name, 0L), moved);
            if (ranked < k) {
                throw new UnsupportedOperationException("ranked set of '" + name + "' draws "
                        + (k - ranked) + " of its " + k + " entries at random (dgc.shared_explore"
                        + "); the Java side does not draw (NumPy's PCG64)");
            }
            out.put(name, top(now, then, k));
        }
        return out;
    }
}
