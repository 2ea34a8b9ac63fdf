// The fedgc phone app module: ExecuTorch runtime, gRPC (OkHttp transport, protobuf-lite), and
// the Java wire codec shared from android_bridge/java (no copy, no symlink).
import com.google.protobuf.gradle.id

plugins {
    id("com.android.application")
    id("org.jetbrains.kotlin.android")
    id("com.google.protobuf")
}

val grpcVersion = "1.68.1"
val protobufVersion = "4.28.3"

android {
    namespace = "org.fedgc.phone"
    compileSdk = 34

    defaultConfig {
        applicationId = "org.fedgc.phone"
        minSdk = 26          // java.util.zip.CRC32, java.nio charsets, android.util.Half
        targetSdk = 34
        versionCode = 1
        versionName = "0.1"
        ndk { abiFilters += listOf("arm64-v8a") }  // the ExecuTorch AAR ships arm64 natives
        // Bridge address and this device's identity; set per build or replace with a settings UI.
        buildConfigField("String", "BRIDGE_HOST", "\"10.0.2.2\"")
        buildConfigField("int", "BRIDGE_PORT", "50051")
        buildConfigField("boolean", "BRIDGE_TLS", "true")
    }

    buildFeatures { buildConfig = true }

    compileOptions {
        sourceCompatibility = JavaVersion.VERSION_17
        targetCompatibility = JavaVersion.VERSION_17
    }
    kotlinOptions { jvmTarget = "17" }

    sourceSets {
        getByName("main") {
            // The wire codec: the same sources javac compiles and tests/test_java_codec.py tests.
            java.srcDir("../../java/src/main/java")
            // The bridge service, owned by android_bridge/proto (generated here as Java lite).
            proto.srcDir("../../proto")
        }
    }

    packaging {
        resources.excludes += listOf("META-INF/INDEX.LIST", "META-INF/io.netty.versions.properties")
    }
}

protobuf {
    protoc { artifact = "com.google.protobuf:protoc:$protobufVersion" }
    plugins {
        id("grpc") { artifact = "io.grpc:protoc-gen-grpc-java:$grpcVersion" }
    }
    generateProtoTasks {
        all().forEach { task ->
            task.builtins { create("java") { option("lite") } }
            task.plugins { create("grpc") { option("lite") } }
        }
    }
}

dependencies {
    // ExecuTorch Android runtime: Module (encoder.pte) and TrainingModule (train_step.pte).
    // Keep its version in step with the Python executorch that wrote the .pte files (1.x).
    implementation("org.pytorch:executorch-android:1.0.0")
    implementation("com.facebook.soloader:soloader:0.10.5")
    implementation("com.facebook.fbjni:fbjni:0.5.1")

    implementation("io.grpc:grpc-okhttp:$grpcVersion")
    implementation("io.grpc:grpc-protobuf-lite:$grpcVersion")
    implementation("io.grpc:grpc-stub:$grpcVersion")
    implementation("com.google.protobuf:protobuf-javalite:$protobufVersion")
    compileOnly("org.apache.tomcat:annotations-api:6.0.53") // @Generated in the gRPC stubs

    implementation("androidx.work:work-runtime-ktx:2.9.1")
    implementation("androidx.appcompat:appcompat:1.7.0")
}
