#!/bin/bash
# The real lab output shown in docs/runbook.md: a 2-node lab, the simulator as SGLang TP2 x PP2, a rank on node2
# SIGKILLed after ready, then every on-call command. Usage: tests/lab/runbook_capture.sh OUTDIR (about 3 min).
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
export PATH=$ROOT/.venv/bin:$PATH ANSIBLE_CONFIG=$ROOT/ansible.cfg ANSIBLE_INVENTORY=$ROOT/inventory/lab
O=${1:?usage: runbook_capture.sh OUTDIR}
mkdir -p "$O"
SSHCFG=$(python -c 'from tests.lab import labctl; print(labctl.default_lab().ssh_config)')
run() { local name=$1; shift; echo "\$ $*" > $O/$name.txt; "$@" >> $O/$name.txt 2>&1; echo "[exit $?]" >> $O/$name.txt; }
python tests/lab/labctl.py up 2 --wipe-nvme --fresh > $O/up.log 2>&1
python tests/lab/demo_model.py >> $O/up.log 2>&1
for pb in base topology model_stage; do ansible-playbook playbooks/$pb.yml -e llmfleet_pp_size=2 >> $O/up.log 2>&1; done
ansible-playbook playbooks/engine.yml -e llmfleet_pp_size=2 -e engine_restart_sec=5 > $O/engine.log 2>&1; echo "engine rc=$?" >> $O/up.log
run status-healthy llmfleet status
ssh -F "$SSHCFG" node2 "pkill -KILL -o -f '[e]ngine_sim.py _rank'"
sleep 3
run status-after-kill llmfleet status
for i in $(seq 1 60); do
  r1=$(ssh -F "$SSHCFG" node1 systemctl show llmfleet-demo.service -p NRestarts --value)
  r2=$(ssh -F "$SSHCFG" node2 systemctl show llmfleet-demo.service -p NRestarts --value)
  [ "$r1" -ge 1 ] && [ "$r2" -ge 1 ] && break; sleep 2; done
sleep 20
run status-healed llmfleet status
run logs-first-failed llmfleet logs --first-failed -n 15
rm -rf $O/bundle
run bundle llmfleet bundle -o $O/bundle
run why-bundle llmfleet why --bundle $O/bundle
run why-live llmfleet why
run rdma-proof llmfleet rdma-proof --duration 2
run stop llmfleet stop
run status-stopped llmfleet status
run restart llmfleet restart
run status-restarted llmfleet status
ansible-playbook playbooks/engine_stop.yml -e llmfleet_pp_size=2 >> $O/up.log 2>&1
python tests/lab/labctl.py down >> $O/up.log 2>&1
echo done > $O/DONE
