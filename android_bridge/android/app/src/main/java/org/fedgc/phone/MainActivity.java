package org.fedgc.phone;

import android.app.Activity;
import android.os.Bundle;
import android.widget.TextView;

/**
 * Minimal launcher: shows where the app expects its files. Rounds run in {@link BridgeClient}
 * (a real deployment runs it from a WorkManager job on unmetered, charging conditions).
 */
public final class MainActivity extends Activity {
    @Override
    protected void onCreate(Bundle state) {
        super.onCreate(state);
        TextView text = new TextView(this);
        text.setText("fedgc phone: put encoder.pte, train_step.pte and manifest.json under "
                + getFilesDir() + "/fedgc, and the bridge CA as ca.pem");
        setContentView(text);
    }
}
