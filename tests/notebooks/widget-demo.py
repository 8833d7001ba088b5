# ---
# jupyter:
#   jupytext:
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# A slider that redraws a plotly FigureWidget in place: the smallest notebook with the round trip the course's
# interactive notebooks rely on (browser widget -> kernel callback -> figure update in the browser).

# %%
import ipywidgets as widgets
import plotly.graph_objects as go
from IPython.display import display

xs = list(range(1, 11))
power = widgets.IntSlider(value=1, min=1, max=5, description="power")
figure = go.FigureWidget(go.Scatter(x=xs, y=xs, mode="lines+markers"), layout={"title": {"text": "y = x^1"}})


def redraw(change: dict) -> None:
    with figure.batch_update():
        figure.data[0].y = [x ** change["new"] for x in xs]
        figure.layout.title.text = f"y = x^{change['new']}"


power.observe(redraw, names="value")
display(widgets.VBox([power, figure]))
