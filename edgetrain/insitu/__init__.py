"""In-situ student-teacher training on a fixed camera node (Kukreja et al. 2019, §III).

A generic *teacher*, trained on canonical views, labels the subjects it recognises confidently;
a tracker carries each label to every frame of the subject's track; the labelled crops are stored
small on the node; a *student* specialised to this camera's viewpoint is trained on them when the
CPU is idle, within the node's memory, with edgetrain's planner. Modules, one concept each:

    scene     synthetic fixed-camera video (seeded, ground truth aside) and real video reading
    detect    background subtraction to boxes; square crops
    track     multi-object tracking (motpy)
    teacher   the canonical-view teacher, cached; the rule that labels whole tracks
    store     WebP crops indexed in SQLite, crash-safe, capped
    capture   video -> detections -> tracks -> labels -> store (resumable)
    student   training from the store within a memory budget, idle-only, resumable
    evaluate  teacher vs student by off-axis angle, label precision/recall, the picture
    files     atomic, checksummed files
    network   the CNN teacher and student share
"""
