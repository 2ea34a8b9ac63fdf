package org.fedgc.wire;

import java.util.ArrayList;
import java.util.Arrays;
import java.util.HashMap;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;

/**
 * Joining a downlink patch ranked by displacement ({@code downlink_context}: the task's
 * {@code patch_context}) to the model a phone holds, as {@code fedgc.patching.apply_patch}
 * with {@code fedgc.context_patch.join}: each tensor named in the context travels as segments
 * {@code NAME#j}, one-dimensional, whose indices are positions within segment {@code j} of the
 * tensor's entries ranked by {@code |held - version0|} ({@link DisplacementRanking#ranked});
 * the segment bounds are fixed fractions of the tensor ({@link #cuts}). Every value replaces
 * an entry (the bridge turns a patch's differences into values before a phone gets it).
 * Stateless; plain Java.
 */
public final class ContextPatch {
    /** Segment boundaries of the ranking, in thousandths of the tensor's entries
     * ({@code fedgc.context_patch.BOUNDS_PER_MILLE}). */
    static final int[] BOUNDS_PER_MILLE = {20, 60, 150, 400};
    /** Between a tensor's name and its segment number. */
    public static final char SEPARATOR = '#';

    private ContextPatch() {
    }

    /** A patch that does not fit the held model: a clear one-line reason. */
    public static final class PatchException extends Exception {
        private static final long serialVersionUID = 1L;

        /** A refusal naming what does not fit. */
        public PatchException(String message) {
            super(message);
        }
    }

    /** The segment boundaries of a tensor of {@code numel} entries, from 0 to numel. */
    public static long[] cuts(long numel) {
        long[] out = new long[BOUNDS_PER_MILLE.length + 2];
        for (int j = 0; j < BOUNDS_PER_MILLE.length; j++) {
            out[j + 1] = numel * BOUNDS_PER_MILLE[j] / 1000;
        }
        out[out.length - 1] = numel;
        return out;
    }

    /** The tensor of {@code context} whose segment {@code segment} is, or null. */
    static String segmentOwner(String segment, Map<String, ?> context) {
        int at = segment.lastIndexOf(SEPARATOR);
        if (at < 0) {
            return null;
        }
        String name = segment.substring(0, at);
        String j = segment.substring(at + 1);
        // str(int(j)) == j: ASCII digits, no sign, no leading zero
        if (!context.containsKey(name) || j.isEmpty() || j.length() > 9
                || (j.length() > 1 && j.charAt(0) == '0')) {
            return null;
        }
        for (int i = 0; i < j.length(); i++) {
            if (j.charAt(i) < '0' || j.charAt(i) > '9') {
                return null;
            }
        }
        return Integer.parseInt(j) <= BOUNDS_PER_MILLE.length ? name : null;
    }

    /**
     * The model {@code patch} (a decoded update) makes of {@code held}, which is left
     * unchanged: the segments of each tensor of {@code version0} (the patch's context: per
     * tensor sent as segments, that tensor of version 0) joined on the ranking of the held
     * tensor against it, every value replacing an entry.
     *
     * @param held the model the phone holds, flat float32 per tensor
     * @param version0 per tensor of the patch's context, version 0 in the form the task names
     * @throws PatchException for a context tensor the model lacks or of another size, a tensor
     *     sent both whole and as segments, a segment whose size is not its ranking's, or a
     *     patch tensor the model lacks or of another size (the messages of
     *     {@code fedgc.patching})
     */
    public static Map<String, float[]> apply(Map<String, float[]> held, SparseUpdate patch,
                                             Map<String, float[]> version0)
            throws PatchException {
        List<String> unknown = new ArrayList<>();
        for (String name : version0.keySet()) {
            if (!held.containsKey(name)) {
                unknown.add(name);
            }
        }
        if (!unknown.isEmpty()) {
            unknown.sort(null);
            throw new PatchException("patch_context names tensors the model lacks: " + unknown);
        }
        List<String> both = new ArrayList<>();
        for (String name : version0.keySet()) {
            if (patch.tensors().containsKey(name)) {
                both.add(name);
            }
        }
        if (!both.isEmpty()) {
            both.sort(null);
            throw new PatchException("patch sends " + both + " both whole and as patch_context "
                    + "segments");
        }
        Map<String, long[]> indices = new LinkedHashMap<>();
        Map<String, float[]> values = new LinkedHashMap<>();
        Map<String, Map<String, SparseTensor>> segments = new LinkedHashMap<>();
        for (Map.Entry<String, SparseTensor> e : patch.tensors().entrySet()) {
            String owner = segmentOwner(e.getKey(), version0);
            if (owner == null) {
                indices.put(e.getKey(), e.getValue().indices());
                values.put(e.getKey(), e.getValue().valuesAsFloat());
            } else {
                segments.computeIfAbsent(owner, n -> new HashMap<>()).put(e.getKey(),
                        e.getValue());
            }
        }
        for (Map.Entry<String, Map<String, SparseTensor>> e : segments.entrySet()) {
            String name = e.getKey();
            float[] base = held.get(name);
            float[] origin = version0.get(name);
            if (base.length != origin.length) {
                throw new PatchException("patch_context tensor '" + name + "': held tensor of "
                        + base.length + " entries and version 0 of " + origin.length + " differ");
            }
            join(name, e.getValue(), DisplacementRanking.ranked(base, origin), indices, values);
        }
        for (Map.Entry<String, long[]> e : indices.entrySet()) {
            String name = e.getKey();
            SparseTensor sent = patch.tensors().get(name);  // null: joined from its segments
            if (!held.containsKey(name)
                    || (sent != null && sent.numel() != held.get(name).length)) {
                throw new PatchException("patch tensor '" + name + "' does not match the held "
                        + "model");
            }
        }
        Map<String, float[]> out = new LinkedHashMap<>();
        for (Map.Entry<String, float[]> e : held.entrySet()) {
            out.put(e.getKey(), e.getValue().clone());
        }
        for (Map.Entry<String, long[]> e : indices.entrySet()) {
            float[] flat = out.get(e.getKey());
            long[] at = e.getValue();
            float[] v = values.get(e.getKey());
            for (int i = 0; i < at.length; i++) {
                flat[(int) at[i]] = v[i];
            }
        }
        return out;
    }

    /** Tensor {@code name}'s entries, flat and sorted, from its segments on {@code order}. */
    private static void join(String name, Map<String, SparseTensor> parts, int[] order,
                             Map<String, long[]> indices, Map<String, float[]> values)
            throws PatchException {
        long[] bounds = cuts(order.length);
        int total = 0;
        for (int j = 0; j + 1 < bounds.length; j++) {
            SparseTensor seg = parts.get(name + SEPARATOR + j);
            if (seg == null) {
                continue;
            }
            long[] shape = seg.shape();
            long size = bounds[j + 1] - bounds[j];
            if (shape.length != 1 || shape[0] != size) {
                throw new PatchException("patch_context tensor '" + name + "': patch segment '"
                        + name + SEPARATOR + j + "' has shape " + Arrays.toString(shape)
                        + ", segment " + j + " of '" + name + "' (" + order.length
                        + " entries) holds " + size);
            }
            total += seg.nnz();
        }
        long[] keys = new long[total];  // flat position above, place in the values below
        float[] joined = new float[total];
        int n = 0;
        for (int j = 0; j + 1 < bounds.length; j++) {
            SparseTensor seg = parts.get(name + SEPARATOR + j);
            if (seg == null) {
                continue;
            }
            for (int i = 0; i < seg.nnz(); i++) {
                keys[n] = ((long) order[(int) (seg.index(i) + bounds[j])] << 32) | n;
                joined[n++] = seg.value(i);
            }
        }
        Arrays.sort(keys);  // the ranking's positions are distinct
        long[] flat = new long[total];
        float[] sorted = new float[total];
        for (int i = 0; i < total; i++) {
            flat[i] = keys[i] >>> 32;
            sorted[i] = joined[(int) (keys[i] & 0xFFFFFFFFL)];
        }
        indices.put(name, flat);
        values.put(name, sorted);
    }
}
