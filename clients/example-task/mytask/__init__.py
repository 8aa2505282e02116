"""An example federation task package (see clients/README.md, "Images")."""
