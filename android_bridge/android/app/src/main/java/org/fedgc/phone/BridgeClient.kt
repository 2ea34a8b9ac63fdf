// The phone's side of the fedgc bridge gRPC service (android_bridge/proto/fedgc_bridge.proto).
package org.fedgc.phone

import com.google.protobuf.ByteString
import io.grpc.ManagedChannel
import io.grpc.Metadata
import io.grpc.StatusRuntimeException
import io.grpc.okhttp.OkHttpChannelBuilder
import io.grpc.stub.MetadataUtils
import io.grpc.stub.StreamObserver
import org.fedgc.bridge.v1.AckReply
import org.fedgc.bridge.v1.AckRequest
import org.fedgc.bridge.v1.FedgcBridgeGrpc
import org.fedgc.bridge.v1.FetchTaskReply
import org.fedgc.bridge.v1.FetchTaskRequest
import org.fedgc.bridge.v1.QueryUploadRequest
import org.fedgc.bridge.v1.RegisterRequest
import org.fedgc.bridge.v1.UploadChunk
import org.fedgc.bridge.v1.UploadStatus
import java.security.MessageDigest
import java.util.concurrent.CountDownLatch
import java.util.concurrent.TimeUnit

/** The link dropped before an upload completed, after [streams] attempts. */
class UploadIncomplete(uploadId: String, streams: Int) :
    java.io.IOException("upload '$uploadId' incomplete after $streams streams")

/** Call metadata key of an upload stream's session: the bridge checks it before the first chunk. */
private val SESSION_KEY: Metadata.Key<String> =
    Metadata.Key.of("fedgc-session", Metadata.ASCII_STRING_MARSHALLER)

/**
 * Register, fetch a task, upload an encoded update in resumable chunks, and ask for the ack.
 * TLS by default (the bridge refuses unknown devices and bad tokens with UNAUTHENTICATED).
 * An upload whose status reads MISSED_ROUND came too late for its round: keep the update pending
 * (the next task's ack_sequence will not name it, so it is folded back into the residual).
 */
class BridgeClient(host: String, port: Int, useTls: Boolean) : AutoCloseable {
    private val channel: ManagedChannel = OkHttpChannelBuilder.forAddress(host, port).let {
        if (useTls) it.useTransportSecurity() else it.usePlaintext()
    }.build()
    private val blocking = FedgcBridgeGrpc.newBlockingStub(channel)
    private val async = FedgcBridgeGrpc.newStub(channel)
    var sessionId: String = ""
        private set
    var pollIntervalS: Double = 5.0
        private set
    /** The longest the bridge holds a FetchTask for a task (long poll; 0: it polls). */
    var maxWaitS: Double = 0.0
        private set

    fun register(deviceId: String, token: String, manifestSha256: String) {
        val reply = blocking.register(RegisterRequest.newBuilder().setDeviceId(deviceId)
            .setToken(token).setManifestSha256(manifestSha256).build())
        sessionId = reply.sessionId
        pollIntervalS = reply.pollIntervalS
        maxWaitS = reply.maxWaitS
    }

    /**
     * The open task, waiting for one up to [maxWaitS] (long poll). [heldConfigSha256] names the
     * config the phone holds: the bridge then leaves configJson empty when it is unchanged.
     * [initialModelSha256]: a phone that holds no model yet offers the version 0 its export
     * builds (heldModelVersion 0 then), so that its first task is a patch on it.
     */
    fun fetchTask(heldModelVersion: Long, heldConfigSha256: String = "",
                  initialModelSha256: List<String> = emptyList()): FetchTaskReply =
        blocking.withDeadlineAfter((maxWaitS * 1000).toLong() + 30_000, TimeUnit.MILLISECONDS)
            .fetchTask(FetchTaskRequest.newBuilder().setSessionId(sessionId)
                .setHeldModelVersion(heldModelVersion).setWaitS(maxWaitS)
                .setHeldConfigSha256(heldConfigSha256)
                .addAllInitialModelSha256(initialModelSha256).build())

    /**
     * Send [data] for [task] from offset 0 (its last [sideBytes] what the round's shared sets
     * send, UploadChunk.side_bytes); after a cut stream, ask QueryUpload where the bridge
     * stands and continue from that offset (the same upload id and digest in every chunk).
     * Returns the offset each stream started at and the last status the bridge gave (its state
     * is final when the stream's answer said so: no Ack needed then).
     */
    fun upload(task: FetchTaskReply, uploadId: String, data: ByteArray, metricsJson: String,
               maxStreams: Int = 8, sideBytes: Int = 0): Pair<List<Long>, UploadStatus?> {
        val digest = MessageDigest.getInstance("SHA-256").digest(data).joinToString("") { "%02x".format(it) }
        val chunkBytes = if (task.maxChunkBytes > 0) task.maxChunkBytes.toInt() else 64 * 1024
        val starts = ArrayList<Long>()
        var offset = 0L
        for (attempt in 1..maxStreams) {
            if (attempt > 1) {
                val status = blocking.queryUpload(QueryUploadRequest.newBuilder()
                    .setSessionId(sessionId).setUploadId(uploadId).build())
                if (status.complete) return Pair(starts, status)
                offset = status.receivedBytes
            }
            starts.add(offset)
            val status = stream(task, uploadId, data, digest, metricsJson, offset.toInt(), chunkBytes,
                sideBytes)
            if (status?.complete == true) return Pair(starts, status)
        }
        throw UploadIncomplete(uploadId, maxStreams)
    }

    /** One client stream from [start]; the bridge's answer (null when the link dropped). */
    private fun stream(task: FetchTaskReply, uploadId: String, data: ByteArray, digest: String,
                       metricsJson: String, start: Int, chunkBytes: Int, sideBytes: Int): UploadStatus? {
        val done = CountDownLatch(1)
        var result: UploadStatus? = null
        val responses = object : StreamObserver<UploadStatus> {
            override fun onNext(value: UploadStatus) { result = value }
            override fun onError(t: Throwable) { done.countDown() }  // cut link: resume via QueryUpload
            override fun onCompleted() { done.countDown() }
        }
        val headers = Metadata().apply { put(SESSION_KEY, sessionId) }
        val requests = async.withInterceptors(MetadataUtils.newAttachHeadersInterceptor(headers))
            .uploadUpdate(responses)
        try {
            var offset = start
            while (offset < data.size) {
                val end = minOf(data.size, offset + chunkBytes)
                // The session travels in the stream's metadata; the chunk leaves it out.
                requests.onNext(UploadChunk.newBuilder().setTaskId(task.taskId)
                    .setUploadId(uploadId).setOffset(offset.toLong())
                    .setData(ByteString.copyFrom(data, offset, end - offset))
                    .setTotalBytes(data.size.toLong()).setSha256(digest).setMetricsJson(metricsJson)
                    .setSideBytes(sideBytes.toLong()).build())
                offset = end
            }
            requests.onCompleted()
        } catch (e: StatusRuntimeException) {
            requests.onError(e)
        }
        done.await(5, TimeUnit.MINUTES)
        return result
    }

    fun ack(uploadId: String): AckReply =
        blocking.ack(AckRequest.newBuilder().setSessionId(sessionId).setUploadId(uploadId).build())

    override fun close() {
        channel.shutdown().awaitTermination(5, TimeUnit.SECONDS)
    }
}
