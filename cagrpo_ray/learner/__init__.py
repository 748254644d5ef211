"""DeepSpeed policy learners: one data-parallel rank (`learner.Learner`, importable without Ray)
and m of them as Ray actors (`group.LearnerGroup`). Import what you need from its module; this
package imports nothing, so that using a `Learner` does not pull in Ray."""
