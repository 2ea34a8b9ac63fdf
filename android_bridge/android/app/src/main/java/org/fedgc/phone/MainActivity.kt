// Starts the periodic fedgc round worker and shows the last round's outcome.
package org.fedgc.phone

import android.os.Bundle
import android.widget.TextView
import androidx.appcompat.app.AppCompatActivity
import androidx.work.Constraints
import androidx.work.ExistingPeriodicWorkPolicy
import androidx.work.NetworkType
import androidx.work.PeriodicWorkRequestBuilder
import androidx.work.WorkManager
import androidx.work.workDataOf
import java.util.concurrent.TimeUnit

class MainActivity : AppCompatActivity() {
    override fun onCreate(savedInstanceState: Bundle?) {
        super.onCreate(savedInstanceState)
        val status = TextView(this).apply { text = "fedgc: waiting for the first round" }
        setContentView(status)
        // Device id and token are provisioned out of band (the bridge refuses unknown devices).
        val prefs = getSharedPreferences("fedgc", MODE_PRIVATE)
        val request = PeriodicWorkRequestBuilder<RoundWorker>(15, TimeUnit.MINUTES)
            .setConstraints(Constraints.Builder().setRequiredNetworkType(NetworkType.UNMETERED)
                .setRequiresCharging(true).build())
            .setInputData(workDataOf(RoundWorker.KEY_DEVICE_ID to prefs.getString("device_id", ""),
                RoundWorker.KEY_TOKEN to prefs.getString("token", "")))
            .build()
        val work = WorkManager.getInstance(this)
        work.enqueueUniquePeriodicWork("fedgc-round", ExistingPeriodicWorkPolicy.KEEP, request)
        work.getWorkInfoByIdLiveData(request.id).observe(this) { info ->
            if (info != null) status.text = "fedgc: ${info.state} ${info.outputData.keyValueMap}"
        }
    }
}
