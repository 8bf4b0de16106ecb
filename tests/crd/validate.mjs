// Validates Kubernetes custom resources against the upstream CRD schemas the
// @kubernetes-models packages ship (compiled from each project's CRDs).
// stdin: a JSON list of documents; stdout: a JSON list, one entry per
// document: {kind, name, result: "ok" | "no-schema" | <the validation error>}.
import { readFileSync } from "node:fs";

const PACKAGES = {
  "gateway.networking.k8s.io": "@kubernetes-models/gateway-api",
  "networking.istio.io": "@kubernetes-models/istio",
  "monitoring.coreos.com": "@kubernetes-models/prometheus-operator",
};

async function check(doc) {
  const [group, version] = doc.apiVersion.split("/");
  const pkg = PACKAGES[group];
  if (!pkg) return "no-schema";
  let mod;
  try {
    mod = await import(`${pkg}/${group}/${version}/${doc.kind}`);
  } catch {
    return "no-schema";
  }
  try {
    new mod[doc.kind](doc).validate();
    return "ok";
  } catch (e) {
    return String(e.message || e);
  }
}

const docs = JSON.parse(readFileSync(0, "utf8"));
const out = [];
for (const doc of docs) {
  out.push({ kind: doc.kind, name: doc.metadata?.name, result: await check(doc) });
}
process.stdout.write(JSON.stringify(out));
