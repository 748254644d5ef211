"""Write k8s/components/monitoring/grafana-dashboard.yaml from deploy/grafana/dashboards/
cagrpo_ray.json.

    python k8s/render_dashboard.py

The ConfigMap is what `kubectl create configmap --from-file` would make (see the file's
header); tests/test_k8s_manifests.py checks that it holds the dashboard unchanged.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "cagrpo_ray.json"
CONFIGMAP = ROOT / "k8s" / "components" / "monitoring" / "grafana-dashboard.yaml"


def main() -> None:
    text = CONFIGMAP.read_text()
    head = text[: text.index("  cagrpo_ray.json: |\n")] + "  cagrpo_ray.json: |\n"
    body = "".join(
        f"    {line}" if line.strip() else line for line in DASHBOARD.read_text().splitlines(True)
    )
    CONFIGMAP.write_text(head + body)


if __name__ == "__main__":
    main()
