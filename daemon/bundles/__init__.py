"""Engine bundles: build, describe, unpack, verify and install llama-server builds."""
