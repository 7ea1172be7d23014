"""The planner: a cost model of training and serving layouts, calibrated against published runs, and the search
over layouts that fit (`scalenlp plan`, `scalenlp.plan()`)."""
