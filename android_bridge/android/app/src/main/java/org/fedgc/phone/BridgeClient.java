package org.fedgc.phone;

import com.google.protobuf.ByteString;
import io.grpc.ManagedChannel;
import io.grpc.okhttp.OkHttpChannelBuilder;
import io.grpc.stub.StreamObserver;
import java.security.KeyStore;
import java.security.MessageDigest;
import java.security.cert.CertificateFactory;
import java.security.cert.X509Certificate;
import java.util.LinkedHashMap;
import java.util.Map;
import java.util.Random;
import java.util.concurrent.CountDownLatch;
import java.util.concurrent.TimeUnit;
import javax.net.ssl.SSLContext;
import javax.net.ssl.TrustManagerFactory;
import org.fedgc.bridge.v1.AckReply;
import org.fedgc.bridge.v1.AckRequest;
import org.fedgc.bridge.v1.FedgcBridgeGrpc;
import org.fedgc.bridge.v1.FetchTaskReply;
import org.fedgc.bridge.v1.FetchTaskRequest;
import org.fedgc.bridge.v1.ModelEncoding;
import org.fedgc.bridge.v1.QueryUploadRequest;
import org.fedgc.bridge.v1.RegisterRequest;
import org.fedgc.bridge.v1.UploadChunk;
import org.fedgc.bridge.v1.UpdateState;
import org.fedgc.bridge.v1.UploadStatus;
import org.fedgc.wire.SparseTensor;
import org.fedgc.wire.SparseUpdate;
import org.fedgc.wire.WireCodec;
import org.json.JSONObject;

/**
 * One phone's rounds against the fedgc bridge, step for step as android_bridge/phone.py does:
 * register, fetch, rebuild the model, train, pseudo-gradient global - local, restore an update
 * the server never aggregated, compress, encode, upload in chunks that resume after a cut, ack.
 */
public final class BridgeClient {
    private final ManagedChannel channel;
    private final FedgcBridgeGrpc.FedgcBridgeBlockingStub stub;
    private final FedgcBridgeGrpc.FedgcBridgeStub asyncStub;
    private final ExportManifest manifest;
    private final PteEncoder encoder;
    private final PteTrainer trainer;
    private final float[][] x;
    private final long[] y;
    private String session;
    private Map<String, float[]> model;
    private long modelVersion = -1;
    private SparseUpdate pending;

    /** {@code caPem}: the CA that signed the bridge's certificate. */
    public BridgeClient(String host, int port, byte[] caPem, ExportManifest manifest,
                        float[][] x, long[] y) throws Exception {
        CertificateFactory cf = CertificateFactory.getInstance("X.509");
        X509Certificate ca = (X509Certificate) cf.generateCertificate(
                new java.io.ByteArrayInputStream(caPem));
        KeyStore ks = KeyStore.getInstance(KeyStore.getDefaultType());
        ks.load(null, null);
        ks.setCertificateEntry("fedgc-ca", ca);
        TrustManagerFactory tmf = TrustManagerFactory.getInstance(
                TrustManagerFactory.getDefaultAlgorithm());
        tmf.init(ks);
        SSLContext tls = SSLContext.getInstance("TLS");
        tls.init(null, tmf.getTrustManagers(), null);
        channel = OkHttpChannelBuilder.forAddress(host, port).useTransportSecurity()
                .sslSocketFactory(tls.getSocketFactory()).build();
        stub = FedgcBridgeGrpc.newBlockingStub(channel);
        asyncStub = FedgcBridgeGrpc.newStub(channel);
        this.manifest = manifest;
        this.encoder = new PteEncoder(manifest);
        this.trainer = new PteTrainer(manifest);
        this.x = x;
        this.y = y;
    }

    public void register(String deviceId, String token) {
        session = stub.register(RegisterRequest.newBuilder().setDeviceId(deviceId)
                .setToken(token).build()).getSessionId();
    }

    /** Poll once; run the round when there is a task. Returns whether a round ran. */
    public boolean runOnce() throws Exception {
        FetchTaskReply task = stub.fetchTask(FetchTaskRequest.newBuilder().setSessionId(session)
                .setHeldModelVersion(modelVersion).build());
        if (!task.getHasTask()) {
            return false;
        }
        JSONObject config = new JSONObject(task.getConfigJson());
        JSONObject train = config.getJSONObject("train");
        encoder.reconfigure(DgcConfig.fromJson(config.getJSONObject("dgc")));
        int batch = trainer.batchSize();
        if (train.getInt("batch_size") != batch) {
            throw new IllegalStateException("task batch_size " + train.getInt("batch_size")
                    + " != exported " + batch);
        }
        Map<String, float[]> global = globalModel(task);
        trainer.setParameters(global);
        int steps = train.getInt("local_steps");
        if (steps == 0) {
            steps = train.getInt("local_epochs") * (int) Math.ceil(x.length / (double) batch);
        }
        float[][] xb = new float[steps][];
        long[][] yb = new long[steps][];
        Random rng = new Random(train.getLong("seed") * 1_000_003L + task.getServerRound());
        for (int s = 0; s < steps; s++) {
            int features = x[0].length;
            xb[s] = new float[batch * features];
            yb[s] = new long[batch];
            for (int i = 0; i < batch; i++) {
                int j = rng.nextInt(x.length);
                System.arraycopy(x[j], 0, xb[s], i * features, features);
                yb[s][i] = y[j];
            }
        }
        double loss = trainer.train(xb, yb, train.getDouble("lr"));
        Map<String, float[]> pseudo = new LinkedHashMap<>();
        for (Map.Entry<String, float[]> e : global.entrySet()) {
            float[] local = trainer.parameter(e.getKey());
            float[] d = new float[local.length];
            for (int i = 0; i < d.length; i++) {
                d[i] = e.getValue()[i] - local[i];
            }
            pseudo.put(e.getKey(), d);
        }
        boolean restored = pending != null && pending.sequence() != task.getAckSequence();
        if (restored) {
            encoder.restore(pending);
        }
        SparseUpdate update = encoder.compress(pseudo, task.getServerRound() - 1,
                task.getSequence());
        byte[] data = WireCodec.encode(update);
        pending = update;
        model = global;
        modelVersion = task.getModelVersion();
        JSONObject metrics = new JSONObject().put("num-examples", x.length)
                .put("train_loss", loss).put("restored", restored ? 1 : 0);
        String uploadId = session.substring(0, 8) + "-" + task.getTaskId();
        upload(task, uploadId, data, metrics.toString());
        AckReply ack = stub.ack(AckRequest.newBuilder().setSessionId(session)
                .setUploadId(uploadId).build());
        return ack.getState() == UpdateState.DELIVERED;
    }

    private Map<String, float[]> globalModel(FetchTaskReply task) throws Exception {
        SparseUpdate m = WireCodec.decode(task.getModelBytes().toByteArray());
        Map<String, float[]> out = new LinkedHashMap<>();
        boolean patch = task.getEncoding() == ModelEncoding.SPARSE_PATCH;
        for (String name : manifest.shapes.keySet()) {
            SparseTensor t = m.tensors().get(name);
            if (patch) {
                float[] held = model.get(name).clone();
                if (t != null) {
                    float[] vals = t.valuesAsFloat();
                    for (int i = 0; i < t.nnz(); i++) {
                        held[(int) t.index(i)] = vals[i];
                    }
                }
                out.put(name, held);
            } else {
                out.put(name, t.toDense());
            }
        }
        return out;
    }

    /** Chunks at the received offset; after a cut, ask QueryUpload and continue from there. */
    private void upload(FetchTaskReply task, String uploadId, byte[] data, String metrics)
            throws Exception {
        String digest = hex(MessageDigest.getInstance("SHA-256").digest(data));
        int chunk = (int) Math.max(1, task.getMaxChunkBytes());
        for (int attempt = 0; attempt < 8; attempt++) {
            UploadStatus status = stub.queryUpload(QueryUploadRequest.newBuilder()
                    .setSessionId(session).setUploadId(uploadId).build());
            if (status.getComplete()) {
                return;
            }
            CountDownLatch done = new CountDownLatch(1);
            StreamObserver<UploadChunk> stream = asyncStub.uploadUpdate(
                    new StreamObserver<UploadStatus>() {
                        @Override public void onNext(UploadStatus s) { }
                        @Override public void onError(Throwable t) { done.countDown(); }
                        @Override public void onCompleted() { done.countDown(); }
                    });
            for (long off = status.getReceivedBytes(); off < data.length; off += chunk) {
                int len = (int) Math.min(chunk, data.length - off);
                stream.onNext(UploadChunk.newBuilder().setSessionId(session)
                        .setTaskId(task.getTaskId()).setUploadId(uploadId).setOffset(off)
                        .setData(ByteString.copyFrom(data, (int) off, len))
                        .setTotalBytes(data.length).setSha256(digest).setMetricsJson(metrics)
                        .build());
            }
            stream.onCompleted();
            done.await(120, TimeUnit.SECONDS);
        }
        throw new IllegalStateException("upload " + uploadId + " incomplete after 8 streams");
    }

    private static String hex(byte[] b) {
        StringBuilder s = new StringBuilder();
        for (byte x : b) {
            s.append(String.format("%02x", x & 0xFF));
        }
        return s.toString();
    }

    public void close() {
        channel.shutdownNow();
    }
}
