"""Normalisation constants of the data sets the models are trained on (ImageNet's mean and std per channel).

Kept with the data: the models' configs (:mod:`repmlp.models.registry`) and the data pipelines read them
from here.
"""

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
