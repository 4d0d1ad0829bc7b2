"""What the audit and the utility study share, and nothing else: the held-out evaluator
(:mod:`~aegis.harness.evaluate`), the output folder that survives a failing disk
(:mod:`~aegis.harness.output`) and the pages' and figures' common styling (:mod:`~aegis.harness.style`)."""
