plugins {
    id("com.android.application") version "8.5.2" apply false
    id("com.google.protobuf") version "0.9.4" apply false
}
