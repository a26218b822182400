"""Reference training jobs that ship with raydeck (data included, nothing to download)."""
