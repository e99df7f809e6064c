"""One module per ``areal-hex`` subcommand (see ``areal_hex_plugin.cli``)."""
