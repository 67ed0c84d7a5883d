// Package attnserve is a client of attnserve, the gRPC service that computes
// transformer attention, LayerNorm and RMSNorm on CPU.
//
// Dial connects; Client's methods call the service's RPCs with the request
// messages of package attnservepb (generated from
// proto/attnserve/v1/attention.proto), and Float32Tensor and Float32s convert
// between Go slices and the wire's Tensor.
package attnserve

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"math"
	"net"
	"os"
	"strings"

	pb "attnserve/clients/go/attnservepb"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// ServiceName is the service's name in health checks and reflection.
const ServiceName = "attnserve.v1.AttentionService"

// Client calls one attnserve server over one connection. It is safe for
// concurrent use.
type Client struct {
	conn    *grpc.ClientConn
	service pb.AttentionServiceClient
	health  healthpb.HealthClient
}

type dialConfig struct {
	token       string
	tls         *tls.Config
	dialOptions []grpc.DialOption
}

// An Option configures Dial.
type Option func(*dialConfig)

// WithToken sends `authorization: Bearer <token>` with every call, for
// servers started with --auth_token_file. Without WithTLS the token is sent
// only to a server on this host (localhost, a loopback address or a Unix
// socket): Dial refuses to send it in the clear over a network.
func WithToken(token string) Option {
	return func(c *dialConfig) { c.token = token }
}

// WithTLS connects over TLS (servers started with --tls_cert/--tls_key).
// A nil config verifies the server against the system's roots; TLSConfig
// builds one from PEM files.
func WithTLS(config *tls.Config) Option {
	return func(c *dialConfig) {
		if config == nil {
			config = &tls.Config{}
		}
		c.tls = config
	}
}

// WithDialOptions adds gRPC dial options, after the client's own.
func WithDialOptions(options ...grpc.DialOption) Option {
	return func(c *dialConfig) { c.dialOptions = append(c.dialOptions, options...) }
}

// TLSConfig reads PEM files into a TLS configuration: caFile, when not
// empty, holds the CAs that sign the server's certificate (else the system's
// roots are used); certFile and keyFile, when not empty, the client
// certificate a server with --tls_client_ca requires.
func TLSConfig(caFile, certFile, keyFile string) (*tls.Config, error) {
	config := &tls.Config{MinVersion: tls.VersionTLS12}
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, err
		}
		config.RootCAs = x509.NewCertPool()
		if !config.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("attnserve: %s holds no PEM certificate", caFile)
		}
	}
	if certFile != "" || keyFile != "" {
		pair, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, err
		}
		config.Certificates = []tls.Certificate{pair}
	}
	return config, nil
}

// Dial connects to the server at address ("host:port", or any gRPC target).
// The connection is made in the background: errors show in the first call.
// Messages of any size are allowed; the server enforces its
// --max_message_mb.
func Dial(address string, options ...Option) (*Client, error) {
	var config dialConfig
	for _, option := range options {
		option(&config)
	}
	dialOptions := []grpc.DialOption{
		// gRPC-Go refuses received messages over 4 MiB by default.
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(math.MaxInt32),
			grpc.MaxCallSendMsgSize(math.MaxInt32)),
	}
	if config.tls != nil {
		dialOptions = append(dialOptions,
			grpc.WithTransportCredentials(credentials.NewTLS(config.tls)))
	} else {
		dialOptions = append(dialOptions, grpc.WithInsecure())
	}
	if config.token != "" {
		if config.tls == nil && !isLocal(address) {
			return nil, fmt.Errorf("attnserve: a token is sent to %s only over TLS "+
				"(WithTLS); without it, only to a server on this host", address)
		}
		dialOptions = append(dialOptions, grpc.WithPerRPCCredentials(
			bearerToken{token: config.token, secure: config.tls != nil}))
	}
	dialOptions = append(dialOptions, config.dialOptions...)
	conn, err := grpc.Dial(address, dialOptions...)
	if err != nil {
		return nil, err
	}
	return &Client{
		conn:    conn,
		service: pb.NewAttentionServiceClient(conn),
		health:  healthpb.NewHealthClient(conn),
	}, nil
}

// isLocal tells whether a target names this host: a Unix socket, localhost
// or a loopback address.
func isLocal(target string) bool {
	if strings.HasPrefix(target, "unix:") {
		return true
	}
	target = strings.TrimPrefix(target, "dns:///")
	target = strings.TrimPrefix(target, "passthrough:///")
	host, _, err := net.SplitHostPort(target)
	if err != nil {
		host = target
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(strings.Trim(host, "[]"))
	return ip != nil && ip.IsLoopback()
}

// bearerToken is the per-call `authorization` metadata of WithToken.
type bearerToken struct {
	token  string
	secure bool
}

func (b bearerToken) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + b.token}, nil
}

// RequireTransportSecurity is false only for the local servers Dial allows
// without TLS.
func (b bearerToken) RequireTransportSecurity() bool { return b.secure }

// Close closes the connection; calls in flight fail with codes.Canceled.
func (c *Client) Close() error { return c.conn.Close() }

// Conn is the underlying connection, for other services on the same server.
func (c *Client) Conn() *grpc.ClientConn { return c.conn }

// Attend computes scaled dot-product attention.
func (c *Client) Attend(ctx context.Context, request *pb.AttendRequest,
	options ...grpc.CallOption) (*pb.AttendResponse, error) {
	return c.service.Attend(ctx, request, options...)
}

// MultiHeadAttend computes multi-head attention with a loaded model's
// weights (request.WeightsSource is a *pb.MultiHeadAttendRequest_Model) or
// weights sent with the request (*pb.MultiHeadAttendRequest_Weights).
func (c *Client) MultiHeadAttend(ctx context.Context,
	request *pb.MultiHeadAttendRequest,
	options ...grpc.CallOption) (*pb.MultiHeadAttendResponse, error) {
	return c.service.MultiHeadAttend(ctx, request, options...)
}

// LayerNorm normalizes the request's input over its trailing dims.
func (c *Client) LayerNorm(ctx context.Context, request *pb.LayerNormRequest,
	options ...grpc.CallOption) (*pb.LayerNormResponse, error) {
	return c.service.LayerNorm(ctx, request, options...)
}

// RmsNorm normalizes the request's input over its trailing dims by their
// root mean square, as torch.nn.RMSNorm.
func (c *Client) RmsNorm(ctx context.Context, request *pb.RmsNormRequest,
	options ...grpc.CallOption) (*pb.RmsNormResponse, error) {
	return c.service.RmsNorm(ctx, request, options...)
}

// ListModels returns the models loaded from the server's model repository,
// sorted by name.
func (c *Client) ListModels(ctx context.Context,
	options ...grpc.CallOption) ([]*pb.ListModelsResponse_Model, error) {
	response, err := c.service.ListModels(ctx, &pb.ListModelsRequest{}, options...)
	if err != nil {
		return nil, err
	}
	return response.GetModels(), nil
}

// GetModelMetadata describes the model called name.
func (c *Client) GetModelMetadata(ctx context.Context, name string,
	options ...grpc.CallOption) (*pb.GetModelMetadataResponse, error) {
	return c.service.GetModelMetadata(ctx,
		&pb.GetModelMetadataRequest{Name: name}, options...)
}

// CreateSession opens a decode session: the server keeps its keys and
// values, so each SessionStep sends only the new tokens.
func (c *Client) CreateSession(ctx context.Context,
	request *pb.CreateSessionRequest,
	options ...grpc.CallOption) (*pb.CreateSessionResponse, error) {
	return c.service.CreateSession(ctx, request, options...)
}

// SessionStep appends the request's new tokens to its session and attends
// them to everything cached (causally among themselves).
func (c *Client) SessionStep(ctx context.Context,
	request *pb.SessionStepRequest,
	options ...grpc.CallOption) (*pb.SessionStepResponse, error) {
	return c.service.SessionStep(ctx, request, options...)
}

// DeleteSession frees the session called sessionID.
func (c *Client) DeleteSession(ctx context.Context, sessionID string,
	options ...grpc.CallOption) error {
	_, err := c.service.DeleteSession(ctx,
		&pb.DeleteSessionRequest{SessionId: sessionID}, options...)
	return err
}

// Serving tells whether the server's health service reports SERVING for
// the attention service. Health checks need no token.
func (c *Client) Serving(ctx context.Context) (bool, error) {
	response, err := c.health.Check(ctx,
		&healthpb.HealthCheckRequest{Service: ServiceName})
	if err != nil {
		return false, err
	}
	return response.GetStatus() == healthpb.HealthCheckResponse_SERVING, nil
}
