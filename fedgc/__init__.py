"""fedgc's shared layer below client, server and the bridge: message contract, settings, files."""
