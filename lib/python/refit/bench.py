"""python -m refit.bench: placeholder"""
