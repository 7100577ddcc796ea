// Command gpufleet-join is one machine of a real-Kubernetes test: it boots from nothing but the
// user data gpufleet rendered for it, the way a real machine does, minus containers.
//
//	gpufleet-join join --user-data FILE --root DIR [--gpus N] [--forward LISTEN=UNIX ...]
//	gpufleet-join renew --root DIR [--expiration-seconds 600]
//
// It runs inside a network namespace of its own (tests/realk8s/machine.py starts it under
// `unshare -n` with the machine's addresses on an interface and a default route), so the kubelet
// finds and reports the addresses the provider reports for the machine, and reaches the API server
// at the address cluster-info advertises through --forward (a TCP address inside, a Unix socket
// outside).
//
// join runs kubeadm's own join code up to the kubelet (its JoinConfiguration loader, token
// discovery with the CA pin, the existing-Node check, the kubeadm-config and kubelet-config
// ConfigMaps read with the bootstrap token, the files kubeadm writes), then the kubelet's own
// TLS bootstrap, then the real kubelet on kubemark's fake container runtime (pods reach Running,
// nvidia.com/gpu is advertised as an extended resource). It stays in the foreground as the
// machine's kubelet until it is killed.
//
// renew asks for a new client certificate with the node's current one, as the kubelet's
// certificate manager does when its certificate nears expiry (signer
// kubernetes.io/kube-apiserver-client-kubelet, expirationSeconds as given).
//
// Every step prints one JSON line {"step": ..., ...} on stdout so the test can follow the boot;
// a failure prints {"error": ..., "step": ...} and exits 1.
package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509/pkix"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"go.opentelemetry.io/otel/trace/noop"
	certificatesv1 "k8s.io/api/certificates/v1"
	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	clientset "k8s.io/client-go/kubernetes"
	restclient "k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	certutil "k8s.io/client-go/util/cert"
	"k8s.io/client-go/util/certificate/csr"
	"k8s.io/client-go/util/keyutil"
	remote "k8s.io/cri-client/pkg"
	fakeremote "k8s.io/cri-client/pkg/fake"
	"k8s.io/klog/v2"
	kubeletconfig "k8s.io/kubelet/config/v1beta1"
	kubeletapp "k8s.io/kubernetes/cmd/kubelet/app"
	kubeletoptions "k8s.io/kubernetes/cmd/kubelet/app/options"
	"k8s.io/kubernetes/cmd/kubeadm/app/discovery"
	"k8s.io/kubernetes/cmd/kubeadm/app/features"
	kubeletphase "k8s.io/kubernetes/cmd/kubeadm/app/phases/kubelet"
	configutil "k8s.io/kubernetes/cmd/kubeadm/app/util/config"
	kubeconfigutil "k8s.io/kubernetes/cmd/kubeadm/app/util/kubeconfig"
	cadvisortest "k8s.io/kubernetes/pkg/kubelet/cadvisor/testing"
	"k8s.io/kubernetes/pkg/kubelet/certificate/bootstrap"
	"k8s.io/kubernetes/pkg/kubelet/cm"
	"k8s.io/kubernetes/pkg/kubemark"
	"sigs.k8s.io/yaml"
)

func say(step string, fields map[string]any) {
	if fields == nil {
		fields = map[string]any{}
	}
	fields["step"] = step
	line, _ := json.Marshal(fields)
	fmt.Println(string(line))
}

func fail(step string, err error) {
	line, _ := json.Marshal(map[string]any{"step": step, "error": err.Error()})
	fmt.Println(string(line))
	os.Exit(1)
}

// cloudConfig is the part of a #cloud-config document a machine acts on here.
type cloudConfig struct {
	Hostname   string `json:"hostname"`
	WriteFiles []struct {
		Path        string `json:"path"`
		Content     string `json:"content"`
		Encoding    string `json:"encoding"`
		Permissions string `json:"permissions"`
	} `json:"write_files"`
	Runcmd []any `json:"runcmd"`
}

// under puts a machine's absolute path inside this machine's root folder.
func under(root, path string) string { return filepath.Join(root, filepath.Clean("/"+path)) }

// joinConfigPath finds `kubeadm join --config PATH` among the document's commands.
func joinConfigPath(doc cloudConfig) (string, error) {
	for _, raw := range doc.Runcmd {
		var argv []string
		switch cmd := raw.(type) {
		case string:
			argv = strings.Fields(cmd)
		case []any:
			for _, a := range cmd {
				argv = append(argv, fmt.Sprint(a))
			}
		}
		for i, arg := range argv {
			if strings.HasSuffix(arg, "kubeadm") && i+1 < len(argv) && argv[i+1] == "join" {
				for j := i + 2; j < len(argv); j++ {
					if argv[j] == "--config" && j+1 < len(argv) {
						return argv[j+1], nil
					}
					if strings.HasPrefix(argv[j], "--config=") {
						return strings.TrimPrefix(argv[j], "--config="), nil
					}
				}
			}
		}
	}
	return "", fmt.Errorf("the user data runs no `kubeadm join --config FILE`")
}

// writeFiles does cloud-init's write_files inside the machine's root.
func writeFiles(root string, doc cloudConfig) error {
	for _, f := range doc.WriteFiles {
		if f.Encoding != "" && f.Encoding != "text/plain" {
			return fmt.Errorf("write_files %s: encoding %q is not handled by this harness", f.Path, f.Encoding)
		}
		mode := os.FileMode(0o644)
		if f.Permissions != "" {
			parsed, err := strconv.ParseUint(f.Permissions, 8, 32)
			if err != nil {
				return fmt.Errorf("write_files %s: permissions %q", f.Path, f.Permissions)
			}
			mode = os.FileMode(parsed)
		}
		target := under(root, f.Path)
		if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(target, []byte(f.Content), mode); err != nil {
			return err
		}
	}
	return nil
}

func runJoin(args []string) {
	fs := flag.NewFlagSet("join", flag.ExitOnError)
	userData := fs.String("user-data", "", "the machine's user data (#cloud-config) as gpufleet rendered it")
	root := fs.String("root", "", "the machine's root folder (its /etc and /var/lib live under it)")
	nodeIP := fs.String("node-ip", "", "the kubelet's --node-ip (default: chosen by the kubelet, as on a machine)")
	kubeletPort := fs.Int("kubelet-port", 10250, "the kubelet's port")
	var forwards forwardFlags
	fs.Var(&forwards, "forward", "LISTEN=UNIX: serve a TCP address of this machine's network by a Unix socket (repeatable)")
	gpus := fs.Int("gpus", 0, "nvidia.com/gpu to advertise")
	discoverOnly := fs.Bool("discover-only", false, "stop after discovery and the existing-Node check")
	discoveryTimeout := fs.Duration("discovery-timeout", 0, "override the JoinConfiguration's discovery timeout")
	_ = fs.Parse(args)
	for _, forward := range forwards {
		if err := forward.start(); err != nil {
			fail("network", err)
		}
	}

	raw, err := os.ReadFile(*userData)
	if err != nil {
		fail("read-user-data", err)
	}
	if !strings.HasPrefix(string(raw), "#cloud-config") {
		fail("read-user-data", fmt.Errorf("not a #cloud-config document"))
	}
	var doc cloudConfig
	if err := yaml.Unmarshal(raw, &doc); err != nil {
		fail("read-user-data", err)
	}
	if err := writeFiles(*root, doc); err != nil {
		fail("write-files", err)
	}
	configPath, err := joinConfigPath(doc)
	if err != nil {
		fail("runcmd", err)
	}
	joinBytes, err := os.ReadFile(under(*root, configPath))
	if err != nil {
		fail("load-join-configuration", err)
	}
	// The machine's files live under its root folder here: the paths the configuration names
	// of files the user data wrote are read there (what a chroot would do).
	for _, f := range doc.WriteFiles {
		joinBytes = []byte(strings.ReplaceAll(string(joinBytes), f.Path, under(*root, f.Path)))
	}
	// kubeadm's own loader: v1beta4 decoded, defaulted and validated as `kubeadm join` does.
	cfg, err := configutil.BytesToJoinConfiguration(joinBytes, configutil.LoadOrDefaultConfigurationOptions{SkipCRIDetect: true})
	if err != nil {
		fail("load-join-configuration", err)
	}
	if *discoveryTimeout > 0 {
		cfg.Timeouts.Discovery = &metav1.Duration{Duration: *discoveryTimeout}
	}
	nodeName := cfg.NodeRegistration.Name
	say("loaded", map[string]any{"node": nodeName, "cri_socket": cfg.NodeRegistration.CRISocket})

	// kubeadm join: discovery (token + CA pin, or file), as joinData.TLSBootstrapCfg does.
	tlsBootstrapCfg, err := discovery.For(nil, cfg)
	if err != nil {
		fail("discovery", err)
	}
	_, cluster, err := kubeconfigutil.GetClusterFromKubeConfig(tlsBootstrapCfg)
	if err != nil {
		fail("discovery", err)
	}
	say("discovered", map[string]any{"server": cluster.Server})

	bootstrapClient, err := kubeconfigutil.ToClientSet(tlsBootstrapCfg)
	if err != nil {
		fail("bootstrap-client", err)
	}
	// kubeadm's preflight: the cluster's kubeadm-config and kubelet-config, read as the token.
	initCfg, err := configutil.FetchInitConfigurationFromCluster(bootstrapClient, nil, "preflight", false, false, true, false)
	if err != nil {
		fail("fetch-init-configuration", err)
	}
	tlsBootstrapCfg.Clusters = map[string]*clientcmdapi.Cluster{initCfg.ClusterName: cluster}
	tlsBootstrapCfg.Contexts[tlsBootstrapCfg.CurrentContext].Cluster = initCfg.ClusterName
	initCfg.NodeRegistration = cfg.NodeRegistration
	say("fetched-init-configuration", map[string]any{"kubernetes_version": initCfg.KubernetesVersion})

	// kubeadm's kubelet-start: refuse to join over a Ready Node of the same name.
	node, err := bootstrapClient.CoreV1().Nodes().Get(context.TODO(), nodeName, metav1.GetOptions{})
	if err != nil && !apierrors.IsNotFound(err) {
		fail("existing-node-check", err)
	}
	for _, cond := range node.Status.Conditions {
		if cond.Type == v1.NodeReady && cond.Status == v1.ConditionTrue {
			fail("existing-node-check", fmt.Errorf("a Node with name %q and status Ready already exists in the cluster", nodeName))
		}
	}
	kubernetesDir := under(*root, "/etc/kubernetes")
	kubeletDir := under(*root, "/var/lib/kubelet")
	bootstrapPath := filepath.Join(kubernetesDir, "bootstrap-kubelet.conf")
	if err := kubeconfigutil.WriteToDisk(bootstrapPath, tlsBootstrapCfg); err != nil {
		fail("write-bootstrap-kubeconfig", err)
	}
	if err := certutil.WriteCert(filepath.Join(kubernetesDir, "pki", "ca.crt"), cluster.CertificateAuthorityData); err != nil {
		fail("write-ca", err)
	}
	if features.Enabled(initCfg.FeatureGates, features.NodeLocalCRISocket) {
		// kubeadm writes the node's own CRI socket as an instance config the cluster's is patched with.
		instance := &kubeletconfig.KubeletConfiguration{ContainerRuntimeEndpoint: cfg.NodeRegistration.CRISocket}
		if err := kubeletphase.WriteInstanceConfigToDisk(instance, kubeletDir); err != nil {
			fail("write-kubelet-config", err)
		}
	}
	if err := kubeletphase.WriteConfigToDisk(&initCfg.ClusterConfiguration, kubeletDir, "", io.Discard); err != nil {
		fail("write-kubelet-config", err)
	}
	if err := kubeletphase.WriteKubeletDynamicEnvFile(&initCfg.ClusterConfiguration, &initCfg.NodeRegistration, true, kubeletDir); err != nil {
		fail("write-kubelet-flags", err)
	}
	say("kubelet-start", map[string]any{"bootstrap_kubeconfig": bootstrapPath})
	if *discoverOnly {
		return
	}
	runKubelet(*root, nodeName, bootstrapPath, kubeletDir, *nodeIP, *kubeletPort, *gpus)
}

// kubeletServer parses the flags kubeadm wrote for the kubelet with the kubelet's own flag set,
// so a flag the kubelet does not know fails here as it would on a machine.
func kubeletServer(kubeletDir string) *kubeletoptions.KubeletServer {
	server, err := kubeletoptions.NewKubeletServer()
	if err != nil {
		fail("kubelet-flags", err)
	}
	args, err := kubeletphase.ReadKubeletDynamicEnvFile(filepath.Join(kubeletDir, "kubeadm-flags.env"))
	if err != nil {
		fail("kubelet-flags", err)
	}
	fs := pflag.NewFlagSet("kubelet", pflag.ContinueOnError)
	server.AddFlags(fs)
	if err := fs.Parse(args); err != nil {
		fail("kubelet-flags", err)
	}
	return server
}

func runKubelet(root, nodeName, bootstrapPath, kubeletDir, nodeIP string, port, gpus int) {
	server := kubeletServer(kubeletDir)
	kubeconfigPath := filepath.Join(root, "etc", "kubernetes", "kubelet.conf")
	certDir := filepath.Join(kubeletDir, "pki")
	ctx := context.Background()
	// The kubelet's own TLS bootstrap: a CSR as system:bootstrap:<token id>, waited on until
	// approved and issued, then kubelet.conf written with the new client certificate.
	if err := bootstrap.LoadClientCert(ctx, kubeconfigPath, bootstrapPath, certDir, types.NodeName(nodeName)); err != nil {
		fail("tls-bootstrap", err)
	}
	_ = os.Remove(bootstrapPath) // kubeadm removes the bootstrap credential once the kubelet has its own
	say("tls-bootstrapped", map[string]any{"kubeconfig": kubeconfigPath})

	clientConfig, client := clientFrom("kubelet-client", kubeconfigPath)

	flags, config := kubemark.GetHollowKubeletConfig(&kubemark.HollowKubeletOptions{
		NodeName: nodeName, KubeletPort: port, KubeletReadOnlyPort: 0, MaxPods: 110, PodsPerCore: 0,
		NodeLabels: server.NodeLabels, RegisterWithTaints: server.RegisterWithTaints,
	})
	// What the machine's kubeadm flags say, over kubemark's defaults.
	config.ProviderID = server.ProviderID
	config.ServerTLSBootstrap = server.ServerTLSBootstrap
	config.Address = "0.0.0.0"
	config.HealthzPort = 0
	// Register and report status every 2 s instead of 10 s: a test waits for the first Ready.
	config.NodeStatusUpdateFrequency.Duration = 2 * time.Second
	if nodeIP != "" {
		flags.NodeIP = nodeIP
	}
	if server.HostnameOverride != "" {
		flags.HostnameOverride = server.HostnameOverride
	}
	flags.CertDirectory = certDir
	heartbeatConfig := *clientConfig
	heartbeatConfig.Timeout = config.NodeStatusUpdateFrequency.Duration
	heartbeatConfig.QPS = -1
	heartbeat, err := clientset.NewForConfig(&heartbeatConfig)
	if err != nil {
		fail("kubelet-client", err)
	}
	var containers cm.ContainerManager = cm.NewStubContainerManager()
	if gpus > 0 {
		containers = cm.NewStubContainerManagerWithDevicePluginResource(v1.ResourceList{
			"nvidia.com/gpu": resource.MustParse(strconv.Itoa(gpus)),
		})
	}
	endpoint, err := fakeremote.GenerateEndpoint()
	if err != nil {
		fail("container-runtime", err)
	}
	runtime := fakeremote.NewFakeRemoteRuntime()
	if err := runtime.Start(endpoint); err != nil {
		fail("container-runtime", err)
	}
	defer runtime.Stop()
	runtimeService, err := remote.NewRemoteRuntimeService(ctx, endpoint, 15*time.Second, noop.NewTracerProvider(), false)
	if err != nil {
		fail("container-runtime", err)
	}
	say("kubelet", map[string]any{"provider_id": config.ProviderID, "server_tls_bootstrap": config.ServerTLSBootstrap,
		"taints": len(config.RegisterWithTaints)})
	kubelet := kubemark.NewHollowKubelet(flags, config, client, heartbeat, &cadvisortest.Fake{NodeName: nodeName},
		runtime.ImageService, runtimeService, containers)
	// No CSI plugin: its CSINode set-up starts before the Node is registered and retries on a
	// fixed backoff (0.03 s .. 15 s, then 2 min); on a loaded test host the registration lands
	// in the 2-minute gap and the Node stays NotReady. GPU nodes here mount no CSI volumes.
	plugins := kubelet.KubeletDeps.VolumePlugins[:0]
	for _, plugin := range kubelet.KubeletDeps.VolumePlugins {
		if plugin.GetPluginName() != "kubernetes.io/csi" {
			plugins = append(plugins, plugin)
		}
	}
	kubelet.KubeletDeps.VolumePlugins = plugins
	// kubemark serves plain HTTP (no TLS options); a machine's kubelet serves TLS, and with
	// rotate-server-certificates asks the cluster for its serving certificate.
	tlsOptions, err := kubeletapp.InitializeTLS(ctx, flags, config)
	if err != nil {
		fail("kubelet-tls", err)
	}
	kubelet.KubeletDeps.TLSOptions = tlsOptions
	kubelet.Run(ctx)
}

// forward is one TCP address inside the machine's network namespace that leads to a Unix
// socket outside it, where the test's relay connects on to the API server on the host's loopback.
type forward struct{ listen, socket string }

type forwardFlags []forward

func (f *forwardFlags) String() string { return fmt.Sprint(*f) }

func (f *forwardFlags) Set(value string) error {
	listen, socket, ok := strings.Cut(value, "=")
	if !ok {
		return fmt.Errorf("--forward wants LISTEN=UNIX, got %q", value)
	}
	*f = append(*f, forward{listen, socket})
	return nil
}

func (f forward) start() error {
	listener, err := net.Listen("tcp", f.listen)
	if err != nil {
		return err
	}
	go func() {
		for {
			conn, err := listener.Accept()
			if err != nil {
				return
			}
			go func() {
				defer conn.Close()
				upstream, err := net.Dial("unix", f.socket)
				if err != nil {
					return
				}
				defer upstream.Close()
				done := make(chan struct{}, 2)
				go func() { _, _ = io.Copy(upstream, conn); done <- struct{}{} }()
				go func() { _, _ = io.Copy(conn, upstream); done <- struct{}{} }()
				<-done
			}()
		}
	}()
	return nil
}

// clientFrom is the client a kubeconfig file describes (the kubelet's, after its TLS bootstrap).
func clientFrom(step, kubeconfigPath string) (*restclient.Config, *clientset.Clientset) {
	loaded, err := clientcmd.LoadFromFile(kubeconfigPath)
	if err != nil {
		fail(step, err)
	}
	config, err := clientcmd.NewDefaultClientConfig(*loaded, &clientcmd.ConfigOverrides{}).ClientConfig()
	if err != nil {
		fail(step, err)
	}
	client, err := clientset.NewForConfig(config)
	if err != nil {
		fail(step, err)
	}
	return config, client
}

func runRenew(args []string) {
	fs := flag.NewFlagSet("renew", flag.ExitOnError)
	root := fs.String("root", "", "the machine's root folder")
	seconds := fs.Int("expiration-seconds", 600, "the certificate lifetime to ask for (600 s is the shortest allowed)")
	_ = fs.Parse(args)
	kubeconfigPath := filepath.Join(*root, "etc", "kubernetes", "kubelet.conf")
	clientConfig, client := clientFrom("renew", kubeconfigPath)
	current, err := certutil.ParseCertsPEM(mustRead(clientConfig.CertData, clientConfig.CertFile))
	if err != nil || len(current) == 0 {
		fail("renew", fmt.Errorf("the kubelet's current certificate: %v", err))
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		fail("renew", err)
	}
	// The same subject as the current certificate, as the kubelet's certificate manager asks.
	csrPEM, err := certutil.MakeCSR(key, &pkix.Name{CommonName: current[0].Subject.CommonName,
		Organization: current[0].Subject.Organization}, nil, nil)
	if err != nil {
		fail("renew", err)
	}
	lifetime := time.Duration(*seconds) * time.Second
	name, uid, err := csr.RequestCertificate(client, csrPEM, "", certificatesv1.KubeAPIServerClientKubeletSignerName,
		&lifetime, []certificatesv1.KeyUsage{certificatesv1.UsageDigitalSignature, certificatesv1.UsageClientAuth}, key)
	if err != nil {
		fail("renew", err)
	}
	say("renew-requested", map[string]any{"csr": name})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	certPEM, err := csr.WaitForCertificate(ctx, client, name, uid)
	if err != nil {
		fail("renew-wait", err)
	}
	certs, err := certutil.ParseCertsPEM(certPEM)
	if err != nil {
		fail("renew-wait", err)
	}
	keyPEM, err := keyutil.MarshalPrivateKeyToPEM(key)
	if err != nil {
		fail("renew", err)
	}
	pair := filepath.Join(*root, "var", "lib", "kubelet", "pki", "kubelet-client-renewed.pem")
	if err := os.WriteFile(pair, append(certPEM, keyPEM...), 0o600); err != nil {
		fail("renew", err)
	}
	say("renewed", map[string]any{"csr": name, "not_after": certs[0].NotAfter.UTC().Format(time.RFC3339),
		"lifetime_seconds": int(certs[0].NotAfter.Sub(certs[0].NotBefore).Seconds()), "pem": pair})
}

func mustRead(data []byte, file string) []byte {
	if len(data) > 0 {
		return data
	}
	read, err := os.ReadFile(file)
	if err != nil {
		fail("renew", err)
	}
	return read
}

func main() {
	klog.InitFlags(nil)
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: gpufleet-join join|renew [flags]")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "join":
		runJoin(os.Args[2:])
	case "renew":
		runRenew(os.Args[2:])
	default:
		fmt.Fprintf(os.Stderr, "unknown command %q\n", os.Args[1])
		os.Exit(2)
	}
}
