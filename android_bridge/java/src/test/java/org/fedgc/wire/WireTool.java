package org.fedgc.wire;

import java.io.BufferedReader;
import java.io.InputStreamReader;
import java.io.PrintStream;
import java.nio.charset.StandardCharsets;

/**
 * A line protocol over stdin/stdout that lets the Python tests drive the Java codec.
 *
 * <pre>
 * codec CODING HEX   ->  OK HEX2           (HEX2 = encode(decode(HEX), CODING))
 *                    ->  REJECT REASON     (decode threw DecodeException)
 * signs MAXNUMEL HEX ->  OK HEX2           (HEX2 = SignsCodec.encode(SignsCodec.decode(HEX)))
 *                    ->  REJECT REASON
 * half BITS32HEX     ->  F16HEX BF16HEX    (HalfFloats.floatToFloat16 / floatToBfloat16)
 * grid LEVELS HEX    ->  OK HEX2 HEX3      (GridValues.valuesOnGrid of decode(HEX): the rounded
 *                                          update grid-coded, the rounding plain)
 * exponent MEAN_BITS32HEX LEVELS_BITS64HEX -> E   (GridValues.exponent)
 * rank NAME=NUMEL,... HEX -> OK SEQUENCE GRID NAME:K:DRAWN,...   (RankRequest.decode)
 *                        ->  REJECT REASON
 * mask NAME=NUMEL,... HEX -> OK SEQUENCE NAME:I.I.I,...          (SharedMask.decode)
 *                        ->  REJECT REASON
 * compact MAXNUMEL NAME=D0xD1,... CONTEXT|- HEX -> OK HEX2       (CompactCodec.decode on the
 *                        ->  REJECT REASON           layout of those shapes, or the patch
 *                                                    layout with CONTEXT=A,B; HEX2 = the update
 *                                                    re-encoded as an update message, AUTO)
 * </pre>
 */
public final class WireTool {
    private WireTool() {
    }

    public static void main(String[] args) throws Exception {
        BufferedReader in = new BufferedReader(new InputStreamReader(System.in,
                StandardCharsets.US_ASCII));
        PrintStream out = new PrintStream(System.out, false, "US-ASCII");
        String line;
        while ((line = in.readLine()) != null) {
            String[] parts = line.trim().split(" ");
            if (parts[0].equals("codec")) {
                byte[] data = WireCodecTest.unhex(parts.length > 2 ? parts[2] : "");
                try {
                    SparseUpdate u = WireCodec.decode(data);
                    out.println("OK " + WireCodecTest.hex(
                            WireCodec.encode(u, IndexCoding.fromName(parts[1]))));
                } catch (DecodeException e) {
                    out.println("REJECT " + e.reason());
                }
            } else if (parts[0].equals("signs")) {
                byte[] data = WireCodecTest.unhex(parts.length > 2 ? parts[2] : "");
                try {
                    SignsUpdate u = SignsCodec.decode(data, Long.parseLong(parts[1]));
                    out.println("OK " + WireCodecTest.hex(SignsCodec.encode(u)));
                } catch (DecodeException e) {
                    out.println("REJECT " + e.reason());
                }
            } else if (parts[0].equals("grid")) {
                try {
                    SparseUpdate[] split = GridValues.valuesOnGrid(WireCodec.decode(
                            WireCodecTest.unhex(parts[2])), Double.parseDouble(parts[1]));
                    out.println("OK " + WireCodecTest.hex(WireCodec.encode(split[0],
                            IndexCoding.AUTO, true)) + " "
                            + WireCodecTest.hex(WireCodec.encode(split[1])));
                } catch (DecodeException e) {
                    out.println("REJECT " + e.reason());
                }
            } else if (parts[0].equals("exponent")) {
                float mean = Float.intBitsToFloat((int) Long.parseLong(parts[1], 16));
                double levels = Double.longBitsToDouble(Long.parseUnsignedLong(parts[2], 16));
                out.println(GridValues.exponent(mean, levels));
            } else if (parts[0].equals("rank")) {
                java.util.Map<String, Long> numels = new java.util.LinkedHashMap<>();
                for (String item : parts[1].split(",")) {
                    String[] kv = item.split("=");
                    numels.put(kv[0], Long.parseLong(kv[1]));
                }
                try {
                    RankRequest r = RankRequest.decode(WireCodecTest.unhex(
                            parts.length > 2 ? parts[2] : ""), numels);
                    StringBuilder sets = new StringBuilder();
                    for (java.util.Map.Entry<String, Long> e : r.counts().entrySet()) {
                        sets.append(sets.length() > 0 ? "," : "").append(e.getKey()).append(':')
                                .append(e.getValue()).append(':')
                                .append(r.explore().getOrDefault(e.getKey(), 0L));
                    }
                    out.println("OK " + Long.toUnsignedString(r.sequence()) + " "
                            + (r.initialOnGrid() ? 1 : 0) + " " + sets);
                } catch (DecodeException e) {
                    out.println("REJECT " + e.reason());
                }
            } else if (parts[0].equals("mask")) {
                java.util.Map<String, Long> numels = new java.util.LinkedHashMap<>();
                for (String item : parts[1].split(",")) {
                    String[] kv = item.split("=");
                    numels.put(kv[0], Long.parseLong(kv[1]));
                }
                try {
                    SharedMask m = SharedMask.decode(WireCodecTest.unhex(
                            parts.length > 2 ? parts[2] : ""), numels);
                    StringBuilder sets = new StringBuilder();
                    for (java.util.Map.Entry<String, long[]> e : m.sets().entrySet()) {
                        sets.append(sets.length() > 0 ? "," : "").append(e.getKey()).append(':');
                        long[] set = e.getValue();
                        for (int i = 0; i < set.length; i++) {
                            sets.append(i > 0 ? "." : "").append(set[i]);
                        }
                    }
                    out.println("OK " + Long.toUnsignedString(m.sequence()) + " " + sets);
                } catch (DecodeException e) {
                    out.println("REJECT " + e.reason());
                }
            } else if (parts[0].equals("compact")) {
                java.util.Map<String, long[]> shapes = new java.util.LinkedHashMap<>();
                for (String item : parts[2].split(",")) {
                    String[] kv = item.split("=", -1);
                    shapes.put(kv[0], kv[1].isEmpty() ? new long[0]
                            : java.util.Arrays.stream(kv[1].split("x"))
                                    .mapToLong(Long::parseLong).toArray());
                }
                CompactCodec.Layout layout = parts[3].equals("-") ? CompactCodec.Layout.of(shapes)
                        : CompactCodec.Layout.patch(shapes, java.util.List.of(parts[3].split(",")));
                try {
                    SparseUpdate u = CompactCodec.decode(WireCodecTest.unhex(
                            parts.length > 4 ? parts[4] : ""), layout, Long.parseLong(parts[1]));
                    out.println("OK " + WireCodecTest.hex(WireCodec.encode(u)));
                } catch (DecodeException e) {
                    out.println("REJECT " + e.reason());
                }
            } else if (parts[0].equals("half")) {
                float f = Float.intBitsToFloat((int) Long.parseLong(parts[1], 16));
                out.println(String.format("%04x %04x", HalfFloats.floatToFloat16(f) & 0xFFFF,
                        HalfFloats.floatToBfloat16(f) & 0xFFFF));
            } else {
                throw new IllegalArgumentException("unknown command '" + parts[0] + "'");
            }
        }
        out.flush();
    }
}
