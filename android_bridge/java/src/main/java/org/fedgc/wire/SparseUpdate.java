package org.fedgc.wire;

import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.Map;

/**
 * A model update as sparse tensors keyed by parameter name, in the sender's order.
 *
 * <p>{@code sequence} is the wire's u64: read it as unsigned ({@link Long#toUnsignedString},
 * {@link Long#compareUnsigned}); every {@code long} is a valid sequence. Immutable.
 */
public final class SparseUpdate {
    private final Map<String, SparseTensor> tensors;
    private final long sequence;

    /**
     * An update of {@code tensors} (copied, iteration order kept) with the sender's
     * {@code sequence} number (unsigned).
     */
    public SparseUpdate(Map<String, SparseTensor> tensors, long sequence) {
        LinkedHashMap<String, SparseTensor> copy = new LinkedHashMap<>();
        for (Map.Entry<String, SparseTensor> e : tensors.entrySet()) {
            if (e.getKey() == null || e.getValue() == null) {
                throw new IllegalArgumentException("tensor names and tensors must not be null");
            }
            copy.put(e.getKey(), e.getValue());
        }
        this.tensors = Collections.unmodifiableMap(copy);
        this.sequence = sequence;
    }

    /** The tensors by name, in message order (unmodifiable). */
    public Map<String, SparseTensor> tensors() {
        return tensors;
    }

    /** The sender's sequence number, an unsigned 64-bit value. */
    public long sequence() {
        return sequence;
    }

    /** Entries carried over all tensors. */
    public long nnz() {
        long n = 0;
        for (SparseTensor t : tensors.values()) {
            n += t.nnz();
        }
        return n;
    }

    @Override
    public boolean equals(Object o) {
        if (!(o instanceof SparseUpdate)) {
            return false;
        }
        SparseUpdate u = (SparseUpdate) o;
        // Order is part of the message, so compare the entry sequences, not just the maps.
        return sequence == u.sequence
                && new java.util.ArrayList<>(tensors.entrySet())
                        .equals(new java.util.ArrayList<>(u.tensors.entrySet()));
    }

    @Override
    public int hashCode() {
        return 31 * tensors.hashCode() + Long.hashCode(sequence);
    }

    @Override
    public String toString() {
        return "SparseUpdate(sequence=" + Long.toUnsignedString(sequence) + ", tensors="
                + tensors + ")";
    }
}
