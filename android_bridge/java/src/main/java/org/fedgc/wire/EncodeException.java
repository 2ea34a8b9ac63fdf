package org.fedgc.wire;

/** An update handed to {@link WireCodec#encode} cannot be put on the wire; the message says why. */
public final class EncodeException extends IllegalArgumentException {
    private static final long serialVersionUID = 1L;

    /** An encode failure with a message naming the bad value and what was expected. */
    public EncodeException(String message) {
        super(message);
    }
}
