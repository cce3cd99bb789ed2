"""Every resume proves itself: the replayed steps against what the interrupted attempt computed.

compare   pure: fingerprints in, a verdict out (verified, diverged, unverifiable)
cadence   pure: which steps are fingerprinted, picked alike by both attempts
digest    a fixed sample of the parameters' elements, hashed
ring      this attempt's fingerprints since its newest bundle
keep      where they are kept for the next attempt: the store, or the control plane
verifier  the loop's side: record the steps, compare after a resume, report the verdict
"""
