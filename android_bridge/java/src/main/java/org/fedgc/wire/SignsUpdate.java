package org.fedgc.wire;

import java.util.ArrayList;
import java.util.Collections;
import java.util.LinkedHashMap;
import java.util.Map;

/**
 * A {@code signs} payload (docs/wire.md section 14, what {@code method = efsign} and
 * {@code method = signvote} clients send): its tensors by name, in the sender's order, and the
 * sender's unsigned 64-bit {@code sequence}. Immutable.
 */
public final class SignsUpdate {
    private final Map<String, SignsTensor> tensors;
    private final long sequence;

    /** An update of {@code tensors} (copied, iteration order kept) numbered {@code sequence}. */
    public SignsUpdate(Map<String, SignsTensor> tensors, long sequence) {
        LinkedHashMap<String, SignsTensor> copy = new LinkedHashMap<>();
        for (Map.Entry<String, SignsTensor> e : tensors.entrySet()) {
            if (e.getKey() == null || e.getValue() == null) {
                throw new IllegalArgumentException("tensor names and tensors must not be null");
            }
            copy.put(e.getKey(), e.getValue());
        }
        this.tensors = Collections.unmodifiableMap(copy);
        this.sequence = sequence;
    }

    /** The tensors by name, in message order (unmodifiable). */
    public Map<String, SignsTensor> tensors() {
        return tensors;
    }

    /** The sender's sequence number, an unsigned 64-bit value. */
    public long sequence() {
        return sequence;
    }

    @Override
    public boolean equals(Object o) {
        if (!(o instanceof SignsUpdate)) {
            return false;
        }
        SignsUpdate u = (SignsUpdate) o;
        return sequence == u.sequence && new ArrayList<>(tensors.entrySet())
                .equals(new ArrayList<>(u.tensors.entrySet()));
    }

    @Override
    public int hashCode() {
        return 31 * tensors.hashCode() + Long.hashCode(sequence);
    }

    @Override
    public String toString() {
        return "SignsUpdate(sequence=" + Long.toUnsignedString(sequence) + ", tensors="
                + tensors + ")";
    }
}
