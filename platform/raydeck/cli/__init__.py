"""raydeck's command line (``raydeck ...``): the top layer, free to import every other."""
