"""flowerdigits: a Flower Message-API app, written as Flower's quickstarts are.

Nothing in it knows fedtrain: it is the app a Flower user already has (a `ClientApp`
with `@app.train()` / `@app.evaluate()`), on scikit-learn's bundled handwritten
digits so it needs no download. `fedtrain.compat.flower_app.FlowerClientApp` runs
it unchanged, in simulation and in a deployment (see ../README.md).
"""
