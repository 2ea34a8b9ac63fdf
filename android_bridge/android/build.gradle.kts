// Plugin versions for the whole project; the app module applies them.
plugins {
    id("com.android.application") version "8.7.3" apply false
    id("org.jetbrains.kotlin.android") version "2.0.21" apply false
    id("com.google.protobuf") version "0.9.4" apply false
}
