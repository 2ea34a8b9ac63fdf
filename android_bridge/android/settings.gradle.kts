// The fedgc phone app: ExecuTorch runtime for the exported encoder and training step, a gRPC
// client of android_bridge/proto/fedgc_bridge.proto, and the Java wire codec.
pluginManagement {
    repositories { google(); mavenCentral(); gradlePluginPortal() }
}
dependencyResolutionManagement {
    repositories { google(); mavenCentral() }
}
rootProject.name = "fedgc-phone"
include(":app")
