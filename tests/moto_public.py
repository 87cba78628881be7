"""moto_server, holding one thing AWS publishes that moto's catalogue lacks: the SSM public parameters of the
deep-learning GPU AMI (calque_ec2.DLAMI_PARAMETERS), each naming an Amazon deep-learning image of moto's own, so
that `pool create --instances` resolves its AMI as it does on AWS. Run as moto_server is: -H HOST -p PORT."""
import datetime
import os
import sys

from moto.ec2.models import ec2_backends
from moto.server import main
from moto.ssm import models as ssm

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from calque_ec2 import DLAMI_PARAMETERS  # noqa: E402

catalogue_load = ssm.ParameterDict._check_loading_status


def with_dlami(self, key):
    """moto's own lazy load of the public parameters, then the AMI one where it is asked for."""
    catalogue_load(self, key)
    arch = next((a for a, name in DLAMI_PARAMETERS.items() if name == key), None)
    if arch and not dict.get(self, key):
        images = ec2_backends[self.account_id][self.region_name].describe_images(
            owners=["amazon"], filters={"architecture": [arch], "name": ["Deep Learning AMI *"]})
        if images:
            super(ssm.ParameterDict, self).__getitem__(key).append(ssm.Parameter(
                account_id=self.account_id, name=key, value=images[0].id, parameter_type="String",
                description=None, allowed_pattern=None, keyid=None,
                last_modified_date=datetime.datetime.now(datetime.timezone.utc), version=1, data_type="aws:ec2:image"))


ssm.ParameterDict._check_loading_status = with_dlami

if __name__ == "__main__":
    main()
