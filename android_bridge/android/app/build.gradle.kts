plugins {
    id("com.android.application")
    id("com.google.protobuf")
}

android {
    namespace = "org.fedgc.phone"
    compileSdk = 34
    defaultConfig {
        applicationId = "org.fedgc.phone"
        minSdk = 26
        targetSdk = 34
        versionCode = 1
        versionName = "0.1.0"
        ndk { abiFilters += listOf("arm64-v8a") }
    }
    compileOptions {
        sourceCompatibility = JavaVersion.VERSION_17
        targetCompatibility = JavaVersion.VERSION_17
    }
    sourceSets {
        getByName("main") {
            // One source of truth: the codec tested on the host by tests/test_android_java.py,
            // and the proto the Python bridge is generated from.
            java.srcDir("../../java/src/main/java")
            proto.srcDir("../../proto")
        }
    }
}

dependencies {
    // ExecuTorch Android runtime (Module, TrainingModule, SGD; XNNPACK backend included).
    implementation("org.pytorch:executorch-android:1.0.0")
    implementation("com.facebook.soloader:soloader:0.10.5")
    implementation("com.facebook.fbjni:fbjni:0.5.1")
    implementation("io.grpc:grpc-okhttp:1.66.0")
    implementation("io.grpc:grpc-protobuf-lite:1.66.0")
    implementation("io.grpc:grpc-stub:1.66.0")
    compileOnly("org.apache.tomcat:annotations-api:6.0.53")
}

protobuf {
    protoc { artifact = "com.google.protobuf:protoc:3.25.3" }
    plugins { create("grpc") { artifact = "io.grpc:protoc-gen-grpc-java:1.66.0" } }
    generateProtoTasks {
        all().forEach { task ->
            task.builtins { create("java") { option("lite") } }
            task.plugins { create("grpc") { option("lite") } }
        }
    }
}
