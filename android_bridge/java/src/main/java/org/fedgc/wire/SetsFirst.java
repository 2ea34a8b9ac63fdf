package org.fedgc.wire;

import java.util.LinkedHashMap;
import java.util.Map;

/**
 * The sets first ({@code dgc.shared_first}): the host step a phone runs around its exported
 * encoder under {@code dgc_sets}, as the reference phone's {@code encoder_round} (and the
 * simulated client's {@code RoundCompressor._take_first}): the pseudo-gradient at the round's
 * sets joins the residual there and leaves with it as grid values ({@link GridValues#takeValues});
 * the encoder then gets the pseudo-gradient zeroed at the sets, so its momentum sees what the
 * simulated client's sees.
 *
 * <p>An encoder that has not compressed yet ({@code started} false: a simulated client's
 * compressor holds no residual then) takes the sets from the pseudo-gradient alone, leaving
 * its residual untouched, and {@link #remainder} (what the sets leave) goes back into the
 * residual after the top-k ({@code restore}). Plain Java; the caller holds the residual.
 */
public final class SetsFirst {
    /** The pseudo-gradient to hand the encoder: copies, zero at the sets. */
    public final Map<String, float[]> gradients;
    /** What the sets send, per tensor in set order ({@link GridValues#encodeValues}). */
    public final Map<String, float[]> sent;
    /** What the sets leave, to restore into the residual after the top-k; null once started. */
    public final SparseUpdate remainder;

    private SetsFirst(Map<String, float[]> gradients, Map<String, float[]> sent,
                      SparseUpdate remainder) {
        this.gradients = gradients;
        this.sent = sent;
        this.remainder = remainder;
    }

    /**
     * Split the round's pseudo-gradient at its shared sets (see the class comment).
     *
     * @param pseudoGradient flat float32 per tensor (left unchanged)
     * @param residual the encoder's residual per tensor, at least as long as the tensor;
     *     changed in place at the sets once {@code started}
     * @param sets the round's sets: sorted flat indices per tensor
     * @param started whether the encoder has compressed before
     * @param levels {@code dgc.shared_levels}, the grid's mean magnitude in steps
     * @param sequence the round, for {@link #remainder}
     * @throws IllegalArgumentException for a set of a tensor the pseudo-gradient or residual
     *     lacks, or an index outside it (nothing changed)
     */
    public static SetsFirst split(Map<String, float[]> pseudoGradient,
                                  Map<String, float[]> residual, Map<String, long[]> sets,
                                  boolean started, double levels, long sequence) {
        for (Map.Entry<String, long[]> e : sets.entrySet()) {
            float[] g = pseudoGradient.get(e.getKey());
            float[] v = residual.get(e.getKey());
            if (g == null || v == null) {
                throw new IllegalArgumentException("shared set for '" + e.getKey() + "', which "
                        + "the " + (g == null ? "pseudo-gradient" : "residual") + " lacks");
            }
            for (long i : e.getValue()) {
                if (i < 0 || i >= g.length || i >= v.length) {
                    throw new IllegalArgumentException("shared set for '" + e.getKey()
                            + "' holds index " + i + ", outside [0, " + g.length + ")");
                }
            }
        }
        Map<String, float[]> gradients = new LinkedHashMap<>();
        for (Map.Entry<String, float[]> e : pseudoGradient.entrySet()) {
            gradients.put(e.getKey(), e.getValue().clone());
        }
        Map<String, float[]> sent = new LinkedHashMap<>();
        Map<String, SparseTensor> left = new LinkedHashMap<>();
        for (Map.Entry<String, long[]> e : sets.entrySet()) {
            String name = e.getKey();
            long[] set = e.getValue();
            float[] g = gradients.get(name);
            float[] source = started ? residual.get(name) : new float[g.length];
            for (long i : set) {
                source[(int) i] = started ? source[(int) i] + g[(int) i] : g[(int) i];
                g[(int) i] = 0f;
            }
            sent.put(name, GridValues.takeValues(source, set, levels));
            if (!started) {
                float[] rest = new float[set.length];
                for (int j = 0; j < set.length; j++) {
                    rest[j] = source[(int) set[j]];
                }
                left.put(name, SparseTensor.ofFloat32(new long[]{g.length}, set.clone(), rest));
            }
        }
        return new SetsFirst(gradients, sent, started ? null : new SparseUpdate(left, sequence));
    }
}
